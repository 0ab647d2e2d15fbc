"""`lowbit quantize`: load a checkpoint with every eligible weight encoded in one format
(quantize-on-load, so the device never holds the dense model), or with a format chosen per
weight under a bits-per-weight budget (`--bpw`, lowbit.quantize.allocate), then write an
artifact."""

from __future__ import annotations

import datetime
import json
import shlex
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

import lowbit
from lowbit.checkpoint.artifact import parse_size, source_digest, write_artifact
from lowbit.checkpoint.hf import resolve_model_dir
from lowbit.checkpoint.loader import LoadedModel, load_model, parse_dtype
from lowbit.checkpoint.quant_plan import QuantPlan, plan_quantization, swappable
from lowbit.checkpoint.tokenizer import Tokenizer
from lowbit.errors import LowbitError
from lowbit.formats import SCALAR_FORMATS, VQ_FORMAT_NAMES, Format, get_format
from lowbit.layers.linear import set_quantized
from lowbit.quantize.allocate import (
    DENSE,
    Candidate,
    allocate,
    plan_record,
    plan_table,
    round_weight,
    tensor_choices,
)
from lowbit.quantize.calibrate import (
    Calibration,
    HessianSums,
    calibrated_quantize,
    collect_hessians,
    round_sequentially,
)
from lowbit.quantize.gptq import DAMP
from lowbit.quantize.sensitivity import WINDOW, KLProbe
from lowbit.quantize.tune import SCHEDULES, TUNABLE, TuneText, teacher, tune_scales
from lowbit.quantize.tune import TOKENS as TUNE_TOKENS
from lowbit.quantize.tune import TOPK as TUNE_TOPK
from lowbit.quantize.tune import WINDOW as TUNE_WINDOW


class Tuning(NamedTuple):
    """--tune-scales: the text, steps, most tokens, teacher tokens kept per position (0: all),
    the norms' dtype with --tune-norms (else None), the latent weights' rate with
    --tune-codes (0: codes fixed), and the rates' schedule (--tune-schedule)."""

    text: Calibration
    steps: int
    tokens: int
    topk: int
    norms: torch.dtype | None
    codes: float = 0.0
    schedule: str = "constant"

DEFAULT_FORMATS = "vq2,nf3,vq3,lut3,nf4,vq4,lut4,nvfp4,int4-g32,fp8,dense"  # the --bpw candidates


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def quantize_model(model: str, fmt: str | None, out: str | Path, *, quantize_lm_head: bool = False,
                   max_shard_size: str = "2GB", device: str | None = None,
                   dtype: str = "bfloat16", command: str | None = None,
                   calib: str | Path | None = None, damp: float = DAMP,
                   bpw: float | None = None, formats: str | None = None,
                   sensitivity: str | None = None, sensitivity_from: str | Path | None = None,
                   tune_steps: int = 0, tune_text: str | Path | None = None,
                   tune_tokens: int = TUNE_TOKENS, tune_norms: bool = False,
                   tune_topk: int | None = None, tune_codes: float = 0.0, sequential: bool = False,
                   tune_schedule: str = "constant", expert_pairs: str | None = None) -> dict:
    """Write the artifact for `model` in format `fmt` (or, with `bpw`, a format per weight
    from `formats` under that budget) at `out`; return its manifest with the run's wall
    time added under totals.seconds. With `calib` (a text file) every weight is rounded by
    GPTQ on the Hessians of that text (lowbit.quantize.calibrate) instead of to its nearest
    code. `sensitivity` (kl or proxy; default kl with `calib`, else proxy) scores the
    candidates of `bpw`; `sensitivity_from` (an earlier `bpw` artifact of the same model,
    calibration and damping) lends its scores instead of scoring again. `tune_steps` (with
    `calib`) then tunes the block scales of the rounded weights against the unquantized
    model's next-token distributions on `tune_text` (default: the calibration text) for that
    many steps, on at most `tune_tokens` of its tokens, keeping the teacher's `tune_topk` most
    likely tokens per position (default TOPK; 0: all), with `tune_norms` the RMSNorm weights too
    and with `tune_codes` (a rate) the codes as well
    (lowbit.quantize.tune). `sequential` (with `calib`) rounds layer by layer, each decoder
    layer on Hessians from the model whose earlier layers are rounded
    (lowbit.quantize.calibrate.round_sequentially). `expert_pairs` ("family", the default, or
    "free"; with `bpw` only) is the allocator's rule for a layer's two expert stacks
    (lowbit.quantize.allocate)."""
    t0 = time.perf_counter()
    candidates = _check_budget_args(fmt, bpw, formats)
    if expert_pairs is not None and bpw is None:
        raise LowbitError("--expert-pairs is how --bpw plans a layer's expert stacks; give --bpw B too.")
    expert_pairs = expert_pairs or "family"
    sensitivity = _check_sensitivity(sensitivity, bpw, calib, sensitivity_from)
    calibration = Calibration.read(calib) if calib is not None else None  # fails before loading
    tuning = _check_tuning(tune_steps, tune_text, tune_tokens, tune_topk, calibration, fmt)
    if tune_norms and tuning is None:
        raise LowbitError("--tune-norms tunes the norms with the scales: give --tune-scales STEPS too.")
    if tune_norms:
        tuning = tuning._replace(norms=parse_dtype(dtype))
    if tune_codes and tuning is None:
        raise LowbitError("--tune-codes moves the codes with the scales: give --tune-scales STEPS too.")
    if not 0 <= tune_codes < 1:
        raise LowbitError(f"--tune-codes {tune_codes}: give Adam's rate on the latent weights, e.g. 0.001.")
    if tune_codes:
        tuning = tuning._replace(codes=tune_codes)
    if tune_schedule not in SCHEDULES:
        raise LowbitError(f"--tune-schedule {tune_schedule!r}: use one of {', '.join(SCHEDULES)}.")
    if tune_schedule != "constant":
        if tuning is None:
            raise LowbitError("--tune-schedule sets the rates of --tune-scales: give --tune-scales STEPS too.")
        tuning = tuning._replace(schedule=tune_schedule)
    if sequential and calibration is None:
        raise LowbitError("--sequential rounds each layer on the Hessians of the already rounded layers before "
                          "it: give --calib FILE too.")
    if not 0 <= damp < 1:
        raise LowbitError(f"--damp {damp}: give a fraction of the mean Hessian diagonal in [0, 1), e.g. 0.01.")
    if calibration is not None and fmt is not None and fmt not in SCALAR_FORMATS + VQ_FORMAT_NAMES:
        get_format(fmt)  # an unknown name says so first
        raise LowbitError(f"--calib rounds the scalar formats and the vector ones ({', '.join(SCALAR_FORMATS + VQ_FORMAT_NAMES)}); "
                          f"{fmt} is not one: drop --calib or pick one of those.")
    path = resolve_model_dir(model)
    max_bytes = parse_size(max_shard_size)
    device = device or default_device()
    provenance = {
        "source": str(path.resolve()),
        "source_digest": source_digest(path),
        "lowbit_version": lowbit.__version__,
        "command": command or shlex.join(["lowbit", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    extra = None
    if bpw is not None:
        table = None
        if sensitivity_from is not None:
            table, sensitivity = _earlier_scores(Path(sensitivity_from), provenance["source_digest"], calibration,
                                                 damp, sensitivity)
        loaded, plan, rounding, extra = _budgeted(path, bpw, candidates, calibration, device, dtype,
                                                  quantize_lm_head, damp, sensitivity, table, tuning, sequential,
                                                  expert_pairs)
        if table is not None:
            extra["allocation"]["sensitivity"]["scores_from"] = str(sensitivity_from)
        fmt = "mixed"
        if rounding is not None:
            provenance["rounding"] = rounding
    elif calibration is None:
        loaded = load_model(path, dtype=dtype, device=device, quantization=fmt,
                            quantize_lm_head=quantize_lm_head)
        plan = loaded.plan or QuantPlan()
    else:
        loaded, plan, provenance["rounding"] = _calibrated(path, fmt, calibration, device, dtype,
                                                           quantize_lm_head, damp, tuning, sequential)
    manifest = write_artifact(
        loaded.model, Path(out), source=path, raw_config=loaded.config.raw, fmt=fmt,
        dense_reasons=plan.dense, provenance=provenance,
        source_dtype=parse_dtype(dtype), max_shard_bytes=max_bytes, extra=extra,
    )
    manifest["totals"]["seconds"] = time.perf_counter() - t0
    return manifest


def _check_budget_args(fmt: str | None, bpw: float | None, formats: str | None) -> list[str]:
    """The --bpw candidates ([] without --bpw): format names and `dense`; refusals of flags
    that do not go together."""
    if bpw is None:
        if formats is not None:
            raise LowbitError("--formats lists the candidates of --bpw; give --bpw B too, or use --format F.")
        if fmt is None:
            raise LowbitError("give --format F (one format for every weight) or --bpw B (a format per weight "
                              "under B bits per weight).")
        return []
    if fmt is not None:
        raise LowbitError(f"--bpw chooses a format per weight, --format {fmt} one for all: give one of them.")
    if not 0 < bpw <= 32:
        raise LowbitError(f"--bpw {bpw}: give the bits per quantized weight, e.g. 4.0 or 3.5.")
    names = [n.strip() for n in (formats or DEFAULT_FORMATS).split(",") if n.strip()]
    if not names:
        raise LowbitError("--formats is empty; list candidate formats, e.g. nf3,lut3,nf4,lut4.")
    for n in names:
        if n != DENSE:
            get_format(n)  # an unknown name says so here
    return list(dict.fromkeys(names))


def _check_tuning(steps: int, text: str | Path | None, tokens: int, topk: int | None,
                  calibration: Calibration | None, fmt: str | None) -> Tuning | None:
    """The tuning text and steps of --tune-scales (None without it)."""
    if steps == 0 and text is None and topk is None:
        return None
    if steps == 0 and topk is not None:
        raise LowbitError("--tune-teacher-topk sets the teacher of --tune-scales; give --tune-scales STEPS too.")
    if steps == 0:
        raise LowbitError("--tune-text is the text of --tune-scales; give --tune-scales STEPS too.")
    if steps < 0:
        raise LowbitError(f"--tune-scales {steps}: give the number of tuning steps, e.g. 200.")
    if calibration is None:
        raise LowbitError("--tune-scales tunes the scales of calibrated roundings: give --calib FILE too.")
    if fmt is not None and fmt not in TUNABLE:
        raise LowbitError(f"--tune-scales tunes the bfloat16 block scales of {', '.join(TUNABLE)}; {fmt} has "
                          "none: drop the flag or pick one of those formats.")
    if tokens < 2:
        raise LowbitError(f"--tune-tokens {tokens}: give the most tokens to tune on, e.g. 65536.")
    topk = TUNE_TOPK if topk is None else topk
    if topk < 0:
        raise LowbitError(f"--tune-teacher-topk {topk}: give the teacher tokens to keep per position, "
                          f"e.g. {TUNE_TOPK}, or 0 for all of them.")
    return Tuning(calibration if text is None else Calibration.read(text), steps, tokens, topk, None)


def _tuning_text(tuning: Tuning | None, path: Path, context: int) -> TuneText | None:
    if tuning is None:
        return None
    ids = Tokenizer(path).encode(tuning.text.text)
    return TuneText.build(tuning.text, ids, tuning.steps, min(TUNE_WINDOW, context), tuning.tokens)


def _check_sensitivity(sensitivity: str | None, bpw: float | None, calib: str | Path | None,
                       sensitivity_from: str | Path | None) -> str | None:
    """kl or proxy for --bpw (None without it, or where the earlier artifact decides)."""
    if bpw is None:
        if sensitivity is not None or sensitivity_from is not None:
            raise LowbitError("--sensitivity scores the candidates of --bpw; give --bpw B too.")
        return None
    if sensitivity is None and sensitivity_from is not None:
        return None
    if sensitivity is None:
        return "kl" if calib is not None else "proxy"
    if sensitivity not in ("kl", "proxy"):
        raise LowbitError(f"--sensitivity {sensitivity}: give kl (measured KL increase) or proxy (Hessian error).")
    if sensitivity == "kl" and calib is None:
        raise LowbitError("--sensitivity kl measures on the calibration text: give --calib FILE too, "
                          "or use --sensitivity proxy.")
    return sensitivity


def _earlier_scores(src: Path, digest: str, calibration: Calibration | None, damp: float,
                    sensitivity: str | None) -> tuple[dict, str]:
    """The candidate scores of an earlier --bpw artifact, if they were measured on the same
    weights, calibration and damping; and their method."""
    try:
        manifest = json.loads((src / "lowbit.json").read_text())
        table, method = manifest["allocation"]["candidates"], manifest["allocation"]["sensitivity"]["method"]
    except (OSError, ValueError, KeyError):
        raise LowbitError(f"--sensitivity-from {src}: not an artifact of `lowbit quantize --bpw` with its scores; "
                          "give such a directory, or drop the flag to score again.") from None
    rounding = manifest["provenance"].get("rounding") or {}
    same = (manifest["provenance"].get("source_digest") == digest
            and (rounding.get("calibration") or {}).get("sha256") == (calibration and calibration.sha256)
            and (calibration is None or rounding.get("damp") == damp))
    if not same:
        raise LowbitError(f"--sensitivity-from {src}: its scores come from other weights, calibration text or "
                          "--damp; give the same ones, or drop the flag to score again.")
    if sensitivity not in (None, method):
        raise LowbitError(f"--sensitivity-from {src} holds {method} scores, not {sensitivity}: drop one of the flags.")
    return table, method


def _budgeted(path: Path, bpw: float, candidates: list[str], calibration: Calibration | None,
              device: str, dtype: str, quantize_lm_head: bool, damp: float,
              sensitivity: str, table: dict | None,
              tuning: Tuning | None = None,
              sequential: bool = False,
              expert_pairs: str = "family") -> tuple[LoadedModel, QuantPlan, dict | None, dict]:
    """Load the dense model in float32, round every planned weight in every candidate
    format (GPTQ with --calib) and score it (or take the scores of `table`), allocate the
    budget, install the chosen roundings."""
    loaded = load_model(path, dtype="float32", device=device)
    formats = [get_format(n) for n in candidates if n != DENSE]
    target = parse_dtype(dtype)
    sums, rounding, probe, ids = None, None, None, []
    if calibration is not None:
        sums, rounding, ids = _hessians(loaded, path, formats, calibration, device, quantize_lm_head)
        rounding["damp"] = damp
    text = _tuning_text(tuning, path, loaded.config.max_position_embeddings)
    reference = None if text is None else teacher(loaded.model, text, device, tuning.topk)
    if sensitivity == "kl":
        probe = KLProbe.build(loaded.model, ids, device, window=min(WINDOW, loaded.config.max_position_embeddings))
    t0 = time.perf_counter()
    dense_bits = target.itemsize * 8 if DENSE in candidates else None
    choices, dense = tensor_choices(loaded.model, formats, sums, damp, quantize_lm_head, probe, dense_bits, table)
    scored = time.perf_counter() - t0
    chosen = allocate(choices, bpw, expert_pairs)
    print(plan_table(choices, chosen, bpw))
    targets = swappable(loaded.model)
    for pname, c in chosen.items():
        if c.format == DENSE:
            dense[pname] = f"kept dense by the --bpw plan ({dtype})"
    rounds = {pname: get_format(c.format) for pname, c in chosen.items() if c.format != DENSE}
    if sequential:  # the scores above stand; the roundings see the rounded layers' outputs
        rounding["sequential"] = round_sequentially(
            loaded.model, rounds, ids, device, loaded.config.max_position_embeddings,
            lambda f, w, h: round_weight(f, w, h, damp))
    else:
        for pname, f in rounds.items():
            mod, attr = targets[pname]
            w = getattr(mod, attr).data
            h = sums.mean(pname).to(w.device) if sums is not None and sums.seen(pname) else None
            set_quantized(mod, attr, round_weight(f, w, h, damp))
    record = _sensitivity_record(sensitivity, sums, probe, chosen, scored)
    if text is not None:
        rounding["tuning"] = _tuned(loaded, text, reference, device, tuning, probe)
    for p in loaded.model.parameters():
        p.data = p.data.to(target)
    if rounding is not None:
        rounding["rounding_seconds"] = round(time.perf_counter() - t0, 2)
    plan = QuantPlan({n: get_format(c.format) for n, c in chosen.items() if c.format != DENSE}, dense)
    return loaded, plan, rounding, {"allocation": plan_record(choices, chosen, bpw, candidates, record, expert_pairs)}


def _sensitivity_record(method: str, sums: HessianSums | None, probe: KLProbe | None,
                        chosen: dict[str, Candidate], seconds: float) -> dict:
    """How the candidates were scored; for kl, the plan's summed KL increases against its
    measured KL (the plan is installed), on the same tokens."""
    if probe is None:
        return {"method": "proxy", "error": "trace((W-Q) H (W-Q)^T), experts by output share" if sums is not None
                else "||W-Q||^2", "seconds": round(seconds, 2)}
    predicted, measured = sum(c.error for c in chosen.values()), probe.kl()
    print(f"sensitivity kl: plan KL on {len(probe.x):,} calibration tokens {measured:.5f}, "
          f"sum of per-weight increases {predicted:.5f}")
    return {"method": "kl", "error": "KL increase with the weight alone rounded",
            "tokens": len(probe.x), "window": probe.window, "seconds": round(seconds, 2),
            "forward_seconds": round(probe.seconds, 2), "plan_kl_predicted": predicted, "plan_kl_measured": measured}


def _hessians(loaded: LoadedModel, path: Path, formats: list[Format], calibration: Calibration,
              device: str, quantize_lm_head: bool) -> tuple[HessianSums, dict, list[int]]:
    """Hessians of every weight some candidate takes, the rounding record, and the tokens."""
    plan = QuantPlan()
    for f in formats:
        plan.quantized.update(plan_quantization(loaded.model, f.name, quantize_lm_head).quantized)
    ids = Tokenizer(path).encode(calibration.text)
    if len(ids) < 2:
        raise LowbitError(f"--calib {calibration.path} gives {len(ids)} token(s); give more text.")
    t0 = time.perf_counter()
    sums = collect_hessians(loaded.model, plan, ids, device, loaded.config.max_position_embeddings)
    return sums, {"method": "gptq (scalar and vector formats; nearest for the others)",
                  "calibration": {"file": calibration.path.name, "sha256": calibration.sha256,
                                  "tokens": len(ids)},
                  "hessian_seconds": round(time.perf_counter() - t0, 2)}, ids


def _calibrated(path: Path, fmt: str, calibration: Calibration, device: str, dtype: str,
                quantize_lm_head: bool, damp: float,
                tuning: Tuning | None = None, sequential: bool = False) -> tuple[LoadedModel, QuantPlan, dict]:
    """Load the dense model in float32, collect Hessians on the calibration tokens, round
    every planned weight by GPTQ (with `sequential`, layer by layer), and cast what stays
    dense to `dtype`."""
    loaded = load_model(path, dtype="float32", device=device)
    plan = plan_quantization(loaded.model, fmt, quantize_lm_head)
    ids = Tokenizer(path).encode(calibration.text)
    if len(ids) < 2:
        raise LowbitError(f"--calib {calibration.path} gives {len(ids)} token(s); give more text.")
    t0 = time.perf_counter()
    context = loaded.config.max_position_embeddings
    sums = None if sequential else collect_hessians(loaded.model, plan, ids, device, context)
    text = _tuning_text(tuning, path, context)
    reference = None if text is None else teacher(loaded.model, text, device, tuning.topk)
    t1 = time.perf_counter()
    if sequential:
        counts = round_sequentially(loaded.model, plan.quantized, ids, device, context,
                                    lambda f, w, h: round_weight(f, w, h, damp))
    else:
        counts = calibrated_quantize(loaded.model, plan, sums, damp)
    t2 = time.perf_counter()
    tuned = None if text is None else _tuned(loaded, text, reference, device, tuning)
    target = parse_dtype(dtype)
    for p in loaded.model.parameters():
        p.data = p.data.to(target)
    rounding = {"method": "gptq, layer by layer" if sequential else "gptq", "damp": damp,
                "calibration": {"file": calibration.path.name, "sha256": calibration.sha256,
                                "tokens": len(ids)},
                "weights": counts, "hessian_seconds": round(t1 - t0, 2),
                "rounding_seconds": round(t2 - t1, 2)}
    if tuned is not None:
        rounding["tuning"] = tuned
    return loaded, plan, rounding


def _tuned(loaded: LoadedModel, text: TuneText, target: list, device: str, tuning: Tuning,
           probe: KLProbe | None = None) -> dict:
    """Tune the installed roundings' scales; print and return the record (with the probe's
    KL after tuning, on the tokens it measured the plan on)."""
    record = tune_scales(loaded.model, text, target, device, norms=tuning.norms, codes=tuning.codes,
                         schedule=tuning.schedule)
    if record["weights"] == 0:
        print("tune-scales: the plan has no weight in a tunable format")
        return record
    print(f"tune-scales: {record['weights']} weights, validation KL {record['validation_kl_before']:.5f} -> "
          f"{record['validation_kl_after']:.5f} (step {record['kept_step']} of {record['steps']}), "
          f"{record['seconds']:.0f} s; teacher {_kept(record['teacher'])}"
          + (f"; {record['codes_changed']:,} codes changed" if "codes_changed" in record else ""))
    if probe is not None:
        record["plan_kl_measured_after"] = probe.kl()
    return record


def _kept(teacher: dict) -> str:
    k = f"top {teacher['top_k']} tokens a position" if teacher["top_k"] else "whole distributions"
    return f"{k}, {teacher['bytes'] / 2**20:.1f} MiB"


def summary_table(manifest: dict) -> str:
    """The final table `lowbit quantize` prints."""
    t = manifest["totals"]
    bpw = "-" if t["bits_per_weight"] is None else f"{t['bits_per_weight']:.3f}"
    rows = [
        ("format", manifest["format"]),
        ("rounding", _rounding(manifest)),
        ("tensors quantized", str(t["quantized_tensors"])),
        ("tensors kept dense", str(t["dense_tensors"])),
        ("bytes before", f"{t['bytes_before'] / 2**20:,.2f} MiB"),
        ("bytes after", f"{t['bytes_after'] / 2**20:,.2f} MiB"),
        ("ratio", f"{t['bytes_before'] / max(t['bytes_after'], 1):.2f}x"),
        ("bits per weight", f"{bpw} (quantized weights)"),
        ("shards", str(len(manifest["shards"]))),
        ("time", f"{t.get('seconds', 0.0):.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _rounding(manifest: dict) -> str:
    r = manifest["provenance"].get("rounding")
    if r is None:
        return "nearest code"
    c = r["calibration"]
    return f"{r['method']} (damp {r['damp']}, {c['tokens']:,} tokens of {c['file']})"
