"""Engine decode steps under Nsight Compute: each kernel's own time and bytes.

A torch profile of a step (lowbit.bench.step_profile) gives spans that overlap under
programmatic dependent launch: a kernel's span includes its wait for the one before. ncu runs
the kernels one at a time, so its durations are each kernel alone, and its DRAM counters say
what each one read. Two modes:

  ncu --profile-from-start off --clock-control none --csv --page raw \\
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\\
launch__grid_size,launch__block_size,launch__registers_per_thread,\\
sm__warps_active.avg.pct_of_peak_sustained_active \\
      --log-file OUT/ncu.csv \\
      python3 scripts/ncu_step.py --random-weights --config C --quantization nvfp4 \\
          --batch 1 --steps 2 --meta OUT/ncu_meta.json
    Builds the engine, puts `batch` one-token requests into decode, runs it to a steady
    state (graphs captured, buckets warm), measures the copy bandwidth, then runs `steps`
    engine steps between cudaProfilerStart and cudaProfilerStop; writes the meta JSON
    (device, commit, batch, steps, layers, copy bandwidth).
  python3 scripts/ncu_step.py --summarize OUT/ncu.csv --meta OUT/ncu_meta.json [--json F]
    Groups the kernels by name and grid, per step: launches, us, MB read, GB/s, % of the
    copy bandwidth, achieved occupancy; the step's sum against the weight bytes' floor.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

NCU_METRICS = ("gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,"
               "launch__block_size,launch__registers_per_thread,"
               "sm__warps_active.avg.pct_of_peak_sustained_active")
_SCALE = {"byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,  # to bytes, us
          "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
          "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


def run(argv: list[str]) -> None:
    import torch

    from lowbit import LLM
    from lowbit.bench.latency import copy_bandwidth, weight_bytes
    from lowbit.bench.step_profile import into_decode
    from lowbit.config import EngineConfig
    from lowbit.distributed import engine_model

    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--context", type=int, default=64, help="prompt tokens of each request")
    p.add_argument("--meta", required=True)
    a = p.parse_args(argv)
    cfg = EngineConfig.from_cli(a)
    llm = LLM(**cfg.llm_kwargs(), loaded=engine_model(cfg))
    engine = llm.engine
    assert engine.device.type == "cuda", "ncu_step needs CUDA"
    into_decode(engine, a.batch, a.context, a.steps + 16, warm_steps=4)
    bw = copy_bandwidth(str(engine.device))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(a.steps):
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    meta = {"device": torch.cuda.get_device_name(0), "commit": os.environ.get("LOWBIT_COMMIT"),
            "command": "ncu ... python3 scripts/ncu_step.py " + " ".join(argv),
            "batch": a.batch, "steps": a.steps, "context": a.context,
            "layers": engine.arch.num_layers, "copy_bandwidth_Bps": bw,
            "weight_bytes": weight_bytes(llm.model, llm.config)}
    Path(a.meta).write_text(json.dumps(meta, indent=1))
    print(json.dumps(meta))


def _num(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read_ncu_csv(text: str) -> list[dict]:
    """ncu --csv --page raw: a header row of metric names, a row of units, a row per kernel.
    Returns one dict per kernel: name, and each metric in us (times), bytes (sizes) or as
    printed (counts, percents)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise SystemExit("no ncu CSV header (\"ID\", ...) in the log: did ncu profile anything?")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    head, units, body = rows[0], rows[1], rows[2:]
    out = []
    for r in body:
        if len(r) != len(head):
            continue
        k = {"name": r[head.index("Kernel Name")]}
        for col, unit, val in zip(head, units, r):
            v = _num(val)
            if v is None or "__" not in col:
                continue
            k[col] = v * _SCALE.get(unit.strip().lower(), 1.0)
        out.append(k)
    return out


def short_name(name: str) -> str:
    """The kernel's function name without return type, template arguments or parameters."""
    base = re.sub(r"\(.*$", "", name)
    base = re.sub(r"<.*$", "", base).strip()
    return base.split("::")[-1].split(" ")[-1][:48] or name[:48]


def summarize(kernels: list[dict], meta: dict) -> dict:
    steps, layers, bw = meta["steps"], meta["layers"], meta["copy_bandwidth_Bps"]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for k in kernels:
        groups[(short_name(k["name"]), int(k.get("launch__grid_size", 0)))].append(k)
    rows = []
    for (name, grid), ks in groups.items():
        us = sum(k.get("gpu__time_duration.sum", 0.0) for k in ks)
        rd = sum(k.get("dram__bytes_read.sum", 0.0) for k in ks)
        occ = [k["sm__warps_active.avg.pct_of_peak_sustained_active"] for k in ks
               if "sm__warps_active.avg.pct_of_peak_sustained_active" in k]
        rows.append({"kernel": name, "grid": grid, "block": int(ks[0].get("launch__block_size", 0)),
                     "regs": int(ks[0].get("launch__registers_per_thread", 0)),
                     "per_step": len(ks) / steps, "us_per_step": us / steps, "us_each": us / len(ks),
                     "mb_read_each": rd / len(ks) / 1e6, "gbps": rd / max(us, 1e-9) / 1e3,
                     "pct_copy": 100 * rd / max(us, 1e-9) * 1e6 / bw,
                     "occupancy_pct": sum(occ) / len(occ) if occ else None})
    rows.sort(key=lambda r: -r["us_per_step"])
    total_us = sum(r["us_per_step"] for r in rows)
    read = sum(k.get("dram__bytes_read.sum", 0.0) for k in kernels) / steps
    return {**meta, "kernels_per_step": len(kernels) / steps, "kernels_per_layer": len(kernels) / steps / layers,
            "sum_us_per_step": total_us, "dram_read_per_step_bytes": read,
            "copy_floor_us": 1e6 * read / bw, "rows": rows}


def format_summary(s: dict) -> str:
    out = [f"{s['device']}, commit {s['commit']}, batch {s['batch']}, {s['steps']} steps: "
           f"{s['kernels_per_step']:.0f} kernels a step ({s['kernels_per_layer']:.1f} a layer); "
           f"their times one at a time sum to {s['sum_us_per_step']:.0f} us a step; they read "
           f"{s['dram_read_per_step_bytes'] / 1e6:.1f} MB, {s['copy_floor_us']:.0f} us at the "
           f"{s['copy_bandwidth_Bps'] / 1e9:.0f} GB/s copy",
           "",
           "| kernel | grid | block | regs | per step | us a step | us each | MB read each | GB/s | % copy | occupancy % |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        occ = f"{r['occupancy_pct']:.0f}" if r["occupancy_pct"] is not None else "-"
        out.append(f"| {r['kernel']} | {r['grid']} | {r['block']} | {r['regs']} | {r['per_step']:.0f} | "
                   f"{r['us_per_step']:.1f} | {r['us_each']:.2f} | {r['mb_read_each']:.2f} | "
                   f"{r['gbps']:.0f} | {r['pct_copy']:.0f} | {occ} |")
    return "\n".join(out)


def main() -> None:
    if "--summarize" not in sys.argv:
        run(sys.argv[1:])
        return
    p = argparse.ArgumentParser()
    p.add_argument("--summarize", required=True)
    p.add_argument("--meta", required=True)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    s = summarize(read_ncu_csv(Path(a.summarize).read_text()), json.loads(Path(a.meta).read_text()))
    if a.json:
        Path(a.json).write_text(json.dumps(s, indent=1))
    print(format_summary(s))


if __name__ == "__main__":
    main()
