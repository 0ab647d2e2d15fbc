"""Weight cases shared by the kernel tests: every decode mode, scale kind and layout."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowbit.kernels.samples import random_fp8_view, random_lut_view
from lowbit.kernels.weights import resolve

# name -> keyword arguments of random_lut_view (or ("fp8", layout))
LUT_CASES = {
    "int4_g32_offsets": dict(bits=4, table="int", block_size=32, scale_kind="f16", offsets=True),
    "nvfp4_two_tables": dict(bits=4, table="e2m1", block_size=16, scale_kind="e4m3", tables=2),
    "mxfp4": dict(bits=4, table="e2m1", block_size=32, scale_kind="e8m0"),
    "nf4": dict(bits=4, table="nf", block_size=64, scale_kind="bf16"),
    "lut4_row_tables": dict(bits=4, table="random", block_size=64, scale_kind="bf16", tables=3),
    "nf3": dict(bits=3, table="nf", block_size=64, scale_kind="bf16"),
    "lut3_offsets": dict(bits=3, table="random", block_size=32, scale_kind="f32", tables=2,
                         offsets=True, global_scale=0.5),
}
FP8_CASES = ("channel", "block", "mx")
ALL_CASES = [*LUT_CASES, *(f"fp8_{c}" for c in FP8_CASES)]


GUARD = 256  # elements of poison on each side of every payload tensor


def guarded(t: torch.Tensor | None) -> torch.Tensor | None:
    """t copied into the middle of a buffer poisoned on both sides (NaN; 0xFF bytes, which
    are NaN as an E8M0 scale), so that a kernel reading past a tensor's ends shows NaN
    instead of whatever the neighbouring heap holds."""
    if t is None:
        return None
    n = t.numel()
    fill = float("nan") if t.dtype.is_floating_point else (255 if t.dtype == torch.uint8 else -1)
    buf = torch.full((GUARD + n + GUARD,), fill, dtype=t.dtype, device=t.device)
    inner = buf[GUARD:GUARD + n].view(t.shape)
    inner.copy_(t)
    return inner


def make_weight(case: str, n: int, k: int, lead: tuple[int, ...] = (), seed: int = 0,
                device: str = "cpu"):
    """A resolved weight whose payload tensors sit between poisoned guards (see guarded)."""
    if case.startswith("fp8_"):
        v = random_fp8_view(n, k, layout=case[4:], lead=lead, seed=seed, device=device)
        return resolve(dataclasses.replace(v, codes=guarded(v.codes), scales=guarded(v.scales)))
    v = random_lut_view(n, k, lead=lead, seed=seed, device=device, **LUT_CASES[case])
    return resolve(dataclasses.replace(
        v, codes=guarded(v.codes), table=guarded(v.table), table_index=guarded(v.table_index),
        scales=guarded(v.scales), offsets=guarded(v.offsets)))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output (unwritten or NaN)"
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def poisoned(*shape: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def compile_offline(script: str) -> dict:
    """Run `script` (Python that prints a JSON object as its last line) in a process without
    the Triton interpreter, from the repository root, and return that object: the offline
    sm_90 compile checks, which need no GPU. Skips where triton is not installed."""
    from lowbit.kernels.runtime import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         cwd=root, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
