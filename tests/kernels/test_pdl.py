"""Programmatic dependent launch (lowbit.kernels.launch, lowbit.kernels.pdl) on the CPU: the
launch switch, and the protocol checked in each decode kernel's PTX compiled for sm_90 (no
store or atomic, and no load but weights, before `griddepcontrol.wait`). The GPU side
(identical results with and without it, inside CUDA graphs) is tests/gpu/test_pdl_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowbit.kernels import launch


def test_pdl_args_off_for_cpu_tensors_and_by_environment(monkeypatch):
    assert launch.pdl_args(torch.zeros(2)) == {"PDL": False}
    assert launch.pdl_status("cpu").startswith("off: not a CUDA launch")
    monkeypatch.setenv("LOWBIT_PDL", "0")
    launch.clear_cache()
    try:
        assert launch._pdl_status(0) == "off: LOWBIT_PDL=0"
    finally:
        monkeypatch.delenv("LOWBIT_PDL")
        launch.clear_cache()


def test_decode_kernels_wait_before_reading_activations():
    """Every Triton kernel of a decode layer compiled with PDL waits exactly once and signals
    its dependents; before the wait there is no store and no atomic, and the only loads are
    the RMSNorm gain (a weight)."""
    from lowbit.kernels.runtime import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(root / "scripts" / "check_pdl.py")],
                         capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.strip().splitlines()]
    names = {r["kernel"] for r in rows}
    assert {"_rms_norm_kernel", "_qk_norm_rope_kernel", "_decode_split_kernel",
            "_decode_reduce_kernel", "_gate_gemv_kernel", "_router_kernel", "_expert_hist_kernel",
            "_expert_place_kernel", "_expert_sort_kernel", "_moe_combine_kernel"} <= names
    for r in rows:
        assert r["launch_pdl"] and r["waits"] == 1 and r["launch_dependents"] == 1, r
        assert r["stores_before"] == 0 and r["atomics_before"] == 0, r
        if r["kernel"] == "_rms_norm_kernel":
            assert r["loads_before"] > 0, r  # the gain is fetched while the last kernel runs
        else:
            assert r["loads_before"] == 0, r
