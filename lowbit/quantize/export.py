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
from lowbit.checkpoint.loader import load_model, parse_dtype


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def quantize_model(model: str, fmt: str, out: str | Path, *, quantize_lm_head: bool = False,
                   max_shard_size: str = "2GB", device: str | None = None,
                   dtype: str = "bfloat16", command: str | None = None) -> dict:
    """Write the artifact for `model` in format `fmt` at `out`; return its manifest with
    the run's wall time added under totals.seconds."""
    t0 = time.perf_counter()
    path = resolve_model_dir(model)
    max_bytes = parse_size(max_shard_size)
    loaded = load_model(path, dtype=dtype, device=device or default_device(), quantization=fmt,
                        quantize_lm_head=quantize_lm_head)
    provenance = {
        "source": str(path.resolve()),
        "source_digest": source_digest(path),
        "lowbit_version": lowbit.__version__,
        "command": command or shlex.join(["lowbit", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    manifest = write_artifact(
        loaded.model, Path(out), source=path, raw_config=loaded.config.raw, fmt=fmt,
        dense_reasons=loaded.plan.dense if loaded.plan else {}, provenance=provenance,
        source_dtype=parse_dtype(dtype), max_shard_bytes=max_bytes,
    )
    manifest["totals"]["seconds"] = time.perf_counter() - t0
    return manifest


def summary_table(manifest: dict) -> str:
    """The final table `lowbit quantize` prints."""
    t = manifest["totals"]
    bpw = "-" if t["bits_per_weight"] is None else f"{t['bits_per_weight']:.3f}"
    rows = [
        ("format", manifest["format"]),
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
