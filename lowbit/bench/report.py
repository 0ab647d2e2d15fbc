"""`lowbit bench report`: PNG plots from bench records (matplotlib Figures, drawn without
pyplot or a display).

- serve_throughput.png: aggregate output throughput and per-user decode rate (median)
  against concurrency, one line per (run, retained context).
- latency.png: tok/s of every latency cell, one bar group per run.
- kl_vs_bpw.png: KL divergence against bits per weight from eval records (fields
  `format`, `bits_per_weight`, `kl_mean`, at the top level or in a `results` list).
"""

from __future__ import annotations

from pathlib import Path

from lowbit.bench.record import load_records


def _run_label(rec: dict) -> str:
    model = rec.get("label") or Path(str(rec.get("model", "?"))).name.removesuffix(".json")
    return f"{model} {rec.get('created', '')[:16]}"


def eval_points(records: list[dict]) -> list[dict]:
    """Distinct (format, bits per weight, KL) points; a record's `results` list wins over
    its top-level fields (an eval record repeats its student there)."""
    seen, pts = set(), []
    for rec in records:
        items = rec.get("results") if isinstance(rec.get("results"), list) else [rec]
        for item in items:
            if not isinstance(item, dict) or not all(k in item for k in ("format", "bits_per_weight", "kl_mean")):
                continue
            key = (str(item["format"]), float(item["bits_per_weight"]), float(item["kl_mean"]))
            if key not in seen:
                seen.add(key)
                pts.append({"format": key[0], "bpw": key[1], "kl": key[2]})
    return pts


def _figure(**kw):
    """A matplotlib Figure outside pyplot: no backend to pick, nothing to close."""
    # imported here: matplotlib is an optional dependency that only this command needs
    from matplotlib.figure import Figure

    return Figure(**kw)


def plot_serve(records: list[dict], out: Path) -> Path | None:
    serve = [r for r in records if r.get("kind") == "serve" and r.get("levels")]
    if not serve:
        return None
    fig = _figure(figsize=(12, 4.5))
    ax1, ax2 = fig.subplots(1, 2)
    for rec in serve:
        for ctx in sorted({lv["context"] for lv in rec["levels"]}):
            lvs = sorted((lv for lv in rec["levels"] if lv["context"] == ctx), key=lambda lv: lv["concurrency"])
            cs = [lv["concurrency"] for lv in lvs]
            label = f"{_run_label(rec)} ctx {ctx}"
            ax1.plot(cs, [lv["summary"]["aggregate_throughput"] for lv in lvs], "o-", label=label)
            ax2.plot(cs, [lv["summary"]["per_user_tok_s"]["median"] for lv in lvs], "o-", label=label)
    for ax, title in ((ax1, "aggregate output throughput (tok/s)"), (ax2, "per-user decode rate, median (tok/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax1.legend(fontsize=7)
    return _save(fig, out / "serve_throughput.png")


def plot_latency(records: list[dict], out: Path) -> Path | None:
    lat = [r for r in records if r.get("kind") == "latency" and r.get("cells")]
    if not lat:
        return None
    fig = _figure(figsize=(10, 4.5))
    ax = fig.subplots()
    width = 0.8 / len(lat)
    tests = list(dict.fromkeys(c["test"] for r in lat for c in r["cells"]))
    for i, rec in enumerate(lat):
        by = {c["test"]: c for c in rec["cells"]}
        xs = [j + i * width for j, t in enumerate(tests) if t in by]
        ys = [by[t]["tok_s_mean"] for t in tests if t in by]
        err = [by[t]["tok_s_sd"] for t in tests if t in by]
        ax.bar(xs, ys, width, yerr=err, label=f"{_run_label(rec)} {rec.get('weight_format', '')}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tests))], tests, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("tok/s")
    ax.legend(fontsize=7)
    return _save(fig, out / "latency.png")


def plot_kl(records: list[dict], out: Path, name: str = "kl_vs_bpw.png") -> Path | None:
    pts = eval_points(records)
    if not pts:
        return None
    positive = [p for p in pts if p["kl"] > 0]
    shown = positive or pts  # the teacher itself (KL 0) has no place on a log axis
    fig = _figure(figsize=(7, 4.5))
    ax = fig.subplots()
    ax.scatter([p["bpw"] for p in shown], [p["kl"] for p in shown])
    for p in shown:
        ax.annotate(p["format"], (p["bpw"], p["kl"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if positive:
        ax.set_yscale("log")
    ax.set_xlabel("bits per weight")
    ax.set_ylabel("KL divergence to the bf16 teacher (mean)")
    ax.grid(True, alpha=0.3)
    return _save(fig, out / name)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def make_report(records_dir: str | Path, out_dir: str | Path, log=print) -> list[Path]:
    records = load_records(records_dir)
    out = Path(out_dir)
    written = []
    for name, fn in (("serve", plot_serve), ("latency", plot_latency), ("eval (KL vs bpw)", plot_kl)):
        path = fn(records, out)
        log(f"{name}: {path}" if path else f"{name}: no records in {records_dir}; skipped")
        if path:
            written.append(path)
    return written
