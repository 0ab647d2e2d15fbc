"""`lowbit quantize`: load a checkpoint with every eligible weight encoded in one format
(quantize-on-load, so the device never holds the dense model), then write an artifact."""

from __future__ import annotations

import datetime
import shlex
import sys
import time
from pathlib import Path

import torch

import lowbit
from lowbit.checkpoint.artifact import parse_size, source_digest, write_artifact
from lowbit.checkpoint.hf import resolve_model_dir
from lowbit.checkpoint.loader import LoadedModel, load_model, parse_dtype
from lowbit.checkpoint.quant_plan import QuantPlan, plan_quantization
from lowbit.checkpoint.tokenizer import Tokenizer
from lowbit.errors import LowbitError
from lowbit.formats import SCALAR_FORMATS, get_format
from lowbit.quantize.calibrate import Calibration, calibrated_quantize, collect_hessians
from lowbit.quantize.gptq import DAMP


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def quantize_model(model: str, fmt: str, out: str | Path, *, quantize_lm_head: bool = False,
                   max_shard_size: str = "2GB", device: str | None = None,
                   dtype: str = "bfloat16", command: str | None = None,
                   calib: str | Path | None = None, damp: float = DAMP) -> dict:
    """Write the artifact for `model` in format `fmt` at `out`; return its manifest with
    the run's wall time added under totals.seconds. With `calib` (a text file) every
    weight is rounded by GPTQ on the Hessians of that text (lowbit.quantize.calibrate)
    instead of to its nearest code."""
    t0 = time.perf_counter()
    calibration = Calibration.read(calib) if calib is not None else None  # fails before loading
    if not 0 <= damp < 1:
        raise LowbitError(f"--damp {damp}: give a fraction of the mean Hessian diagonal in [0, 1), e.g. 0.01.")
    if calibration is not None and fmt not in SCALAR_FORMATS:
        get_format(fmt)  # an unknown name says so first
        raise LowbitError(f"--calib rounds the scalar formats ({', '.join(SCALAR_FORMATS)}); "
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
    if calibration is None:
        loaded = load_model(path, dtype=dtype, device=device, quantization=fmt,
                            quantize_lm_head=quantize_lm_head)
        plan = loaded.plan or QuantPlan()
    else:
        loaded, plan, provenance["rounding"] = _calibrated(path, fmt, calibration, device, dtype,
                                                           quantize_lm_head, damp)
    manifest = write_artifact(
        loaded.model, Path(out), source=path, raw_config=loaded.config.raw, fmt=fmt,
        dense_reasons=plan.dense, provenance=provenance,
        source_dtype=parse_dtype(dtype), max_shard_bytes=max_bytes,
    )
    manifest["totals"]["seconds"] = time.perf_counter() - t0
    return manifest


def _calibrated(path: Path, fmt: str, calibration: Calibration, device: str, dtype: str,
                quantize_lm_head: bool, damp: float) -> tuple[LoadedModel, QuantPlan, dict]:
    """Load the dense model in float32, collect Hessians on the calibration tokens, round
    every planned weight by GPTQ, and cast what stays dense to `dtype`."""
    loaded = load_model(path, dtype="float32", device=device)
    plan = plan_quantization(loaded.model, fmt, quantize_lm_head)
    ids = Tokenizer(path).encode(calibration.text)
    if len(ids) < 2:
        raise LowbitError(f"--calib {calibration.path} gives {len(ids)} token(s); give more text.")
    t0 = time.perf_counter()
    sums = collect_hessians(loaded.model, plan, ids, device, loaded.config.max_position_embeddings)
    t1 = time.perf_counter()
    counts = calibrated_quantize(loaded.model, plan, sums, damp)
    target = parse_dtype(dtype)
    for p in loaded.model.parameters():
        p.data = p.data.to(target)
    rounding = {"method": "gptq", "damp": damp,
                "calibration": {"file": calibration.path.name, "sha256": calibration.sha256,
                                "tokens": len(ids)},
                "weights": counts, "hessian_seconds": round(t1 - t0, 2),
                "rounding_seconds": round(time.perf_counter() - t1, 2)}
    return loaded, plan, rounding


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
