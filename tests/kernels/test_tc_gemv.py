"""Admission of the tensor-core nvfp4 kernels (lowbit.kernels.tc_gemv, tc_moe) on the CPU:
each refusal names its reason. The kernels themselves are Gluon (CUDA only): their
correctness tests are tests/gpu/test_tc_gemv_gpu.py and tests/gpu/test_tc_moe_gpu.py.
"""

from __future__ import annotations

import torch

from lowbit.kernels.samples import random_lut_view
from lowbit.kernels.weights import resolve


def test_tc_gemv_admission_reasons():
    """The tensor-core nvfp4 routes refuse what their kernel cannot read, with the reason, in
    this order: format, tables, activation dtype, M, K, alignment, then the device."""
    from lowbit.kernels import moe_op
    from lowbit.kernels.tc_gemv import tc_gemv_refusal
    from lowbit.kernels.tc_moe import tc_moe_refusal
    from tests.kernels.cases import make_weight

    nv = make_weight("nvfp4_two_tables", 256, 512)
    one = resolve(random_lut_view(256, 512, bits=4, table="e2m1", block_size=16, scale_kind="e4m3"))
    x = torch.randn(3, 512).bfloat16()
    assert "nvfp4 only" in tc_gemv_refusal(x, make_weight("int4_g32_offsets", 256, 512))
    assert tc_gemv_refusal(x, nv) == tc_gemv_refusal(x, one)  # per-row tables are read
    assert "bf16" in tc_gemv_refusal(x.half(), one)
    assert "M = 17 > 16" in tc_gemv_refusal(torch.randn(17, 512).bfloat16(), one)
    k400 = resolve(random_lut_view(256, 400, bits=4, table="e2m1", block_size=16, scale_kind="e4m3"))
    assert "multiple of 128" in tc_gemv_refusal(torch.randn(1, 400).bfloat16(), k400)
    assert "CUDA only" in tc_gemv_refusal(x, one)
    stack = resolve(random_lut_view(64, 512, lead=(8,), bits=4, table="e2m1", block_size=16,
                                    scale_kind="e4m3"))
    w2 = resolve(random_lut_view(512, 32, lead=(8,), bits=4, table="e2m1", block_size=16,
                                 scale_kind="e4m3"))
    assert "biases" in tc_moe_refusal(x, stack, w2, b13=torch.zeros(8, 64))
    assert "K = 32" in tc_moe_refusal(x, stack, w2)  # w2's K (the expert width) too
    def call(t):
        return moe_op.MoeCall(torch.randn(t, 512).bfloat16(), torch.zeros(t, 2, dtype=torch.int32),
                              torch.rand(t, 2), stack, w2)

    # above 64 tokens only where the device config tunes an expert-grouped schedule (none
    # for this shape and device), and never above 512
    assert "65 tokens > 64 and no expert-grouped schedule" in moe_op._admit_tc(call(65))
    assert "513 tokens > 512" in moe_op._admit_tc(call(513))


def test_kernels_compile_for_sm90_without_shared_memory_in_the_loop():
    """The Gluon kernels compile for the H200's sm_90 on any machine (scripts/tune_tc_gemv.py
    --static, in a process without the interpreter), and the layout map holds: the K loop
    loads codes 16 bytes a thread and feeds the tensor cores with no trip through shared
    memory (a layout conversion there would show as LDS / STS in the loop)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    from lowbit.kernels import tc_gemv

    if not tc_gemv.HAS_GLUON:
        pytest.skip("triton without Gluon")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(root / "scripts" / "tune_tc_gemv.py"), "--static"],
                         capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(stats) == {"linear", "moe_fc1", "moe_fc2", "grouped_fc1", "grouped_fc2",
                          "grouped_fc1_mb32", "linear_prefetch2", "moe_fc2_prefetch2",
                          "linear_ring4", "moe_fc1_ring4", "moe_fc2_ring4", "grouped_fc1_ring4",
                          "linear_ring3_k384", "linear_bn16", "moe_fc2_bn16"}
    # a narrow program (one warp, 16 rows) runs the same per-warp K loop as four warps of 64
    assert stats["linear_bn16"]["loop"] <= 1.05 * stats["linear"]["loop"], stats["linear_bn16"]
    assert stats["linear_bn16"]["regs"] <= stats["linear"]["regs"] + 16, stats["linear_bn16"]
    # scale rows of 24 bytes (K = 384): the ring still copies them 4 bytes at a time
    k384 = stats.pop("linear_ring3_k384")
    assert k384["ops"].get("LDGSTS", 0) > 0 and k384["ops"].get("LDG", 0) == 0, k384
    assert k384["stack"] == 0 and k384["async_before_wait"] > 0, k384
    ring = {name: stats.pop(name) for name in list(stats) if name.endswith("_ring4")}
    for name, st in ring.items():
        # RING: every global load of the K loop is a cp.async into shared memory (LDGSTS), read
        # back with LDS; the plain gemv and FC2 request the first three steps' codes and
        # scales before the wait (BN 64 x BK 256 over 128 threads: four 16-byte copies of
        # codes and two 4-byte copies of scales a step), FC1 waits for the routing first
        assert st["ops"].get("HMMA", 0) >= 16 and st["ops"].get("LDGSTS", 0) > 0, (name, st)
        assert st["ops"].get("LDG", 0) == 0 and st["ops"].get("LDS", 0) > 0, (name, st)
        assert st["stack"] == 0 and st["pdl_waits"] == 1, (name, st)
        assert st["regs"] < stats[name.replace("_ring4", "")]["regs"], (name, st)  # nothing held
        first = name in ("moe_fc1_ring4", "grouped_fc1_ring4")  # these wait for the routing first
        assert st["async_before_wait"] == (0 if first else 18), (name, st)
    for name, st in stats.items():
        assert st["loop"] > 100 and st["ops"].get("HMMA", 0) >= 16, (name, st)
        assert st["ldg128"] > 0 and st["ldg_u8"] == 0, (name, st)
        assert st["stack"] == 0 and st["regs"] <= 255, (name, st)  # no register spills
        # programmatic dependent launch: one wait; the plain gemv and FC2 load their first
        # weight tile before it (FC2 after its expert id, which the router wrote two kernels
        # earlier), FC1 and the grouped kernels first wait for the routing
        assert st["pdl_waits"] == 1, (name, st)
        assert (st["loads_before_wait"] > 0) == name.startswith(("linear", "moe_fc2")), (name, st)
        if not name.startswith("moe_fc2"):  # FC2 broadcasts its activation through shared memory
            assert st["ops"].get("LDS", 0) == 0 and st["ops"].get("STS", 0) == 0, (name, st)
    # PREFETCH 2 puts the second K step's codes and scales in flight before the wait too
    for name in ("linear", "moe_fc2"):
        one, two = stats[name]["loads_before_wait"], stats[f"{name}_prefetch2"]["loads_before_wait"]
        assert two >= 2 * one - 1 and two > one, (name, one, two)


def test_ring_admission_falls_back_to_registers_with_a_warning(caplog):
    """A RING config runs only where its shared memory fits the device (and has two slots or
    more); otherwise the launch keeps the register loop and says why, once."""
    import logging

    from lowbit.kernels.tc_gemv import RING_SMEM_SLACK, _warn_ring, admitted_ring, ring_bytes

    # BN 64, BK 256, MB 8, bf16 x: 4 x (8 KiB codes + 1 KiB scales + 4 KiB x)
    assert ring_bytes(4, 64, 256, 8, 0, 2) == 4 * (8192 + 1024 + 4096)
    assert ring_bytes(3, 64, 256, 8, 2, 4) == 3 * (8192 + 1024 + 2 * 256 * 4)  # FC2: gate, up
    h100 = 227 << 10
    assert admitted_ring(0, 128, 512, 16, 0, 2, h100) == 0
    assert admitted_ring(4, 64, 256, 8, 0, 2, h100) == 4
    need = ring_bytes(6, 128, 512, 16, 0, 2) + RING_SMEM_SLACK
    assert need > h100
    _warn_ring.cache_clear()
    with caplog.at_level(logging.WARNING, logger="lowbit"):
        assert admitted_ring(6, 128, 512, 16, 0, 2, h100) == 0
        assert admitted_ring(1, 64, 256, 8, 0, 2, h100) == 0
        assert admitted_ring(4, 64, 256, 8, 0, 2, h100, aligned=False) == 0
    text = caplog.text
    assert f"{need} bytes of shared memory" in text and "RING 6 refused" in text
    assert "at least 2 slots" in text and "not 4-byte aligned" in text
    # exactly at the limit still runs
    assert admitted_ring(6, 128, 512, 16, 0, 2, need) == 6


def test_ring_scale_alignment_of_real_weights():
    """The ring copies scales 4 bytes at a time: K = 384 gives 24-byte scale rows (4-byte
    aligned, not 16: the kernel tells the compiler so), a scale view at an odd byte offset is
    refused."""
    import types

    from lowbit.kernels.decode import weight_args
    from lowbit.kernels.tc_gemv import ring_scales_aligned

    base = torch.zeros(64, dtype=torch.uint8)
    ok = types.SimpleNamespace(stride_sn=24, stride_se=24 * 1030, scales=base)
    assert ring_scales_aligned(ok)
    assert not ring_scales_aligned(types.SimpleNamespace(stride_sn=6, stride_se=0, scales=base))
    assert not ring_scales_aligned(types.SimpleNamespace(stride_sn=24, stride_se=0, scales=base[1:]))
    w = resolve(random_lut_view(1030, 384, bits=4, table="e2m1", block_size=16, scale_kind="e4m3"))
    assert ring_scales_aligned(weight_args(w))


def test_ring_switch_and_the_bench_line(monkeypatch):
    """LOWBIT_TC_RING=0 runs tuned RING configs on their register loop (no warning: asked
    for), and the bench record names how many tuned configs ask for the ring, and whether
    they get it."""
    from lowbit.bench import latency
    from lowbit.kernels import launch, tc_gemv

    table = {"tc_gemv": {"nvfp4:5120x2048": {"1": {"BN": 64, "RING": 4}, "8": {"BN": 64}}},
             "tc_moe": {"nvfp4:128x2048": {"1": {"fc1": {"RING": 3}, "fc2": {"RING": 0}},
                                           "32": {"grouped": {"RING": 4}}}}}
    assert tc_gemv.ring_configs(table) == 3
    assert tc_gemv.ring_configs({"tc_gemv": {"nvfp4:1x1": {"1": {"BN": 64}}}}) == 0
    monkeypatch.setattr(launch, "_device", lambda device: table)
    monkeypatch.delenv("LOWBIT_TC_RING", raising=False)
    assert tc_gemv.admitted_ring(4, 64, 256, 8, 0, 2, 227 << 10) == 4
    assert latency.ring_line() == "tensor-core gemv: 3 tuned configs load through the shared-memory ring (RING)"
    monkeypatch.setenv("LOWBIT_TC_RING", "0")
    assert tc_gemv.admitted_ring(4, 64, 256, 8, 0, 2, 227 << 10) == 0
    assert "ring OFF: LOWBIT_TC_RING=0 (3 tuned configs" in latency.ring_line()
    monkeypatch.setattr(launch, "_device", lambda device: {})
    assert latency.ring_line() is None


def test_narrow_switch_rewrites_small_launches_only(monkeypatch):
    """LOWBIT_TC_NARROW (an A/B switch read at every launch): 1 gives launches of up to 8
    activation rows one-warp programs of 16 rows at WAVES 2 (no K split where the grid
    already fills the SMs), 2 adds PREFETCH 2; larger launches, and the unset switch, keep
    the tuned config; anything else is an error. The bench line says it is on."""
    import pytest

    from lowbit.bench import latency
    from lowbit.bench.latency import Variant
    from lowbit.kernels import launch, tc_gemv

    tuned = {"BN": 64, "BK": 256, "num_warps": 4, "WAVES": 4, "PREFETCH": 1}
    monkeypatch.delenv("LOWBIT_TC_NARROW", raising=False)
    assert tc_gemv.narrowed(tuned, 1) is tuned and tc_gemv.narrow_mode() == 0
    monkeypatch.setenv("LOWBIT_TC_NARROW", "1")
    got = tc_gemv.narrowed(tuned, 8)
    assert got == dict(tuned, BN=16, num_warps=1, WAVES=2, RING=0) and tuned["BN"] == 64
    assert tc_gemv.narrowed(tuned, 9) is tuned  # M > 8: the tuned (tensor-core width) config
    monkeypatch.setenv("LOWBIT_TC_NARROW", "2")
    assert tc_gemv.narrowed(tuned, 1)["PREFETCH"] == 2
    # the engine's C1 grids on 132 SMs: QKV 5120 rows -> 320 programs, no split; o_proj
    # 2048 rows (16 K steps) -> 128 programs, 3 splits; per-slot FC1 1536 rows x 8 slots, none
    assert tc_gemv.split_for(5120 // 16, 2048 // 256, 2, 132) == 1
    assert tc_gemv.split_for(2048 // 16, 4096 // 256, 2, 132) == 3
    assert tc_gemv.split_for(1536 // 16 * 8, 2048 // 256, 2, 132) == 1
    monkeypatch.setattr(launch, "_device", lambda device: {})
    assert "NARROW: LOWBIT_TC_NARROW=2" in latency.ring_line()
    assert Variant.parse("narrow=LOWBIT_TC_NARROW:1").env == {"LOWBIT_TC_NARROW": "1"}
    monkeypatch.setenv("LOWBIT_TC_NARROW", "yes")
    with pytest.raises(ValueError, match="expected 0, 1 or 2"):
        tc_gemv.narrowed(tuned, 1)
