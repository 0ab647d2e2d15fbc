"""The kernels on a CUDA GPU at real sizes, against their torch twins, plus CUDA-graph capture
and replay of the decode routes and split-K determinism. Skipped (marked) without CUDA.

Tolerances: float32 outputs; gemv computes in float32 (rel 1e-5); gemm / MoE round to bf16
where the twin does (dot_dtype), so only summation order differs (rel 1e-3).
"""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels import linear, moe_experts
from tests.kernels.cases import ALL_CASES, make_weight, poisoned, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"
ODD_CASES = ["int4_g32_offsets", "nvfp4_two_tables", "lut3_offsets", "fp8_block"]


def _gemv(x, w, bias, out, **kw):
    from lowbit.kernels.dequant_gemm import lut_gemv

    return lut_gemv(x, w, bias, out=out, **kw)


@pytest.mark.parametrize("case", ALL_CASES)
def test_gemv_real_size(case):
    from lowbit.kernels.dequant_gemm import reference_linear

    n, k = 4096, 4096
    w = make_weight(case, n, k, seed=3, device=DEV)
    bias = torch.randn(n, device=DEV)
    for m in (1, 16):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        out = poisoned(m, n, dtype=torch.float32, device=DEV)
        _gemv(x, w, bias, out)
        assert rel_err(out, reference_linear(x.float(), w, bias)) < 1e-5, (case, m)


@pytest.mark.parametrize("case", ODD_CASES)
def test_gemv_odd_shapes(case):
    from lowbit.kernels.dequant_gemm import reference_linear

    n, k = 1030, 1000
    w = make_weight(case, n, k, seed=4, device=DEV)
    for m in (1, 3):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        out = poisoned(m, n, dtype=torch.float32, device=DEV)
        _gemv(x, w, None, out, config=dict(BN=32, G=32, SPLIT_K=3))
        assert rel_err(out, reference_linear(x.float(), w)) < 1e-5, (case, m)


@pytest.mark.parametrize("case", ALL_CASES)
def test_gemm_real_size(case):
    from lowbit.kernels.dequant_gemm import lut_gemm, reference_linear

    n, k = 2048, 4096 if case in ODD_CASES else 3000
    w = make_weight(case, n, k, seed=5, device=DEV)
    for m in (17, 129):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        out = poisoned(m, n, dtype=torch.float32, device=DEV)
        lut_gemm(x, w, None, out=out)
        ref = reference_linear(x.float(), w, dot_dtype=torch.bfloat16)
        assert rel_err(out, ref) < 1e-3, (case, m)


@pytest.mark.parametrize("case", ALL_CASES)
def test_dequantize_real_size(case):
    """The decode launch of route triton_lut_dequant: the twin's decode rounded to bf16
    (round-to-nearest-even on the GPU) in a NaN-poisoned buffer, bit-equal but where the
    kernel's float32 chain (an FMA for scale and offset) lands on the other side of a bf16
    rounding boundary: there one bf16 step apart, on <= 0.1 % of the weights; the routed
    linear at M = 512 picks it and matches the twin's GEMM."""
    from lowbit.kernels import routes
    from lowbit.kernels.dequant import dequantize
    from lowbit.kernels.dequant_gemm import reference_linear
    from lowbit.kernels.runtime import round_for_dot

    n, k = 5120, 2048 if case in ODD_CASES else 3000
    w = make_weight(case, n, k, seed=6, device=DEV)
    out = poisoned(n, k, dtype=torch.bfloat16, device=DEV)
    dequantize(w, k, torch.bfloat16, out=out)
    want = round_for_dot(w.dense(k), torch.bfloat16)
    diff = (out.float() - want).abs()
    assert torch.isfinite(out).all(), case
    assert (diff <= want.abs() * 2.0**-7).all(), (case, diff.max())
    assert (diff > 0).float().mean() <= 1e-3, (case, (diff > 0).float().mean())
    routes.reset_counters()
    x = torch.randn(512, k, device=DEV, dtype=torch.bfloat16)
    y = linear(x, w)
    ran = {c["route"] for c in routes.counters()["route_calls"] if c["op"] == "linear"}
    assert ran == {"triton_lut_dequant"}, ran
    assert rel_err(y, reference_linear(x.float(), w, dot_dtype=torch.bfloat16)) < 1e-2, case


@pytest.mark.parametrize("bk", [16, 64, 128])
def test_e2m1_tiles_exact(bk):
    """The PTX decode of e2m1_tile_bf16 (bf16x2 bit placement, subnormal 0.5 code, scale
    multiply in bf16x2): every byte value, exact against torch."""
    from tests.kernels.e2m1_tiles import probe

    got, want = probe(DEV, n=70, kc=352, bk=bk)
    assert torch.equal(got.float(), want.float()), (got - want).abs().max()


@pytest.mark.parametrize("layout", ["channel", "block"])
def test_w8a8(layout):
    from lowbit.kernels.fp8_gemm import fp8_w8a8, reference_w8a8
    from lowbit.kernels.samples import random_fp8_view

    w = random_fp8_view(3000, 4096, layout=layout, device=DEV)
    for m in (1, 33):
        x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
        out = poisoned(m, 3000, dtype=torch.float32, device=DEV)
        fp8_w8a8(x, w, None, out=out)
        assert rel_err(out, reference_w8a8(x.float(), w)) < 1e-3


@pytest.mark.parametrize("case", ["nvfp4_two_tables", "int4_g32_offsets", "nf4"])
def test_fused_moe_real_size(case):
    from lowbit.kernels.moe import fused_moe, reference_moe

    e, top, h, inter = 64, 8, 2048, 768
    w13 = make_weight(case, 2 * inter, h, lead=(e,), seed=1, device=DEV)
    w2 = make_weight(case, h, inter, lead=(e,), seed=2, device=DEV)
    for mode, t in (("decode", 1), ("decode", 16), ("grouped", 16), ("grouped", 300)):
        ids = torch.rand(t, e, device=DEV).topk(top, -1).indices.to(torch.int32)
        ids[: t // 2, 0] = 5  # skewed: half the tokens share one expert
        ids[: t // 2, 1:] = torch.arange(6, 6 + top - 1, device=DEV, dtype=torch.int32)
        wts = torch.rand(t, top, device=DEV)
        x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
        out = poisoned(t, h, dtype=torch.float32, device=DEV)
        fused_moe(x, ids, wts, w13, w2, mode=mode, out=out)
        ref = reference_moe(x.float(), ids, wts, w13, w2, dot_dtype=torch.bfloat16)
        assert rel_err(out, ref) < 1e-3, (case, mode, t)


def test_split_k_is_deterministic():
    w = make_weight("nf4", 4096, 14336, seed=6, device=DEV)
    x = torch.randn(2, 14336, device=DEV, dtype=torch.bfloat16)
    outs = []
    for _ in range(3):
        out = poisoned(2, 4096, dtype=torch.float32, device=DEV)
        _gemv(x, w, None, out, config=dict(BN=32, G=32, SPLIT_K=4))
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


def test_cuda_graph_replay_of_decode_routes(monkeypatch):
    from lowbit.kernels.dequant_gemm import reference_linear
    from lowbit.kernels.moe import reference_moe

    monkeypatch.setenv("LOWBIT_ROUTE_LINEAR", "triton_lut_gemv")
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "triton_fused_moe_decode")
    w = make_weight("nvfp4_two_tables", 2048, 4096, seed=7, device=DEV)
    e, top, h, inter = 32, 4, 1024, 512
    w13 = make_weight("int4_g32_offsets", 2 * inter, h, lead=(e,), seed=8, device=DEV)
    w2 = make_weight("int4_g32_offsets", h, inter, lead=(e,), seed=9, device=DEV)
    x = torch.randn(4, 4096, device=DEV, dtype=torch.bfloat16)
    xm = torch.randn(4, h, device=DEV, dtype=torch.bfloat16)
    ids = torch.rand(4, e, device=DEV).topk(top, -1).indices.to(torch.int32)
    wts = torch.rand(4, top, device=DEV)
    linear(x, w), moe_experts(xm, ids, wts, w13, w2)  # warm up: compile, resolve tables
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = linear(x, w)
        ym = moe_experts(xm, ids, wts, w13, w2)
    for _ in range(2):  # fresh inputs written in place, then replay
        x.copy_(torch.randn_like(x))
        xm.copy_(torch.randn_like(xm))
        ids.copy_(torch.rand(4, e, device=DEV).topk(top, -1).indices.to(torch.int32))
        wts.copy_(torch.rand(4, top, device=DEV))
        y.fill_(float("nan"))
        ym.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, reference_linear(x, w)) < 1e-2
        assert rel_err(ym, reference_moe(xm, ids, wts, w13, w2, dot_dtype=torch.bfloat16)) < 1e-2


@pytest.mark.parametrize("case", ["nvfp4_two_tables", "int4_g32_offsets", "nf3"])
def test_gemm_split_k_real_size(case):
    """Decode-sized M through the tensor-core gemm with K split (auto and 5 splits, the
    latter not dividing K's 112 BK steps evenly): the twin's rounding, the bias once, and
    the same bits on a repeat (deterministic split sum, counters reset)."""
    from lowbit.kernels.dequant_gemm import lut_gemm, reference_linear

    n, k = 4096, 14336
    w = make_weight(case, n, k, seed=11, device=DEV)
    bias = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    for m, cfg in ((8, dict(BM=16, BN=64, BK=128)), (5, dict(BM=16, BN=64, BK=128, SPLIT_K=5)),
                   (33, dict(BM=64, BN=64, BK=64))):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        outs = []
        for _ in range(2):
            out = poisoned(m, n, dtype=torch.float32, device=DEV)
            lut_gemm(x, w, bias, config=cfg, out=out)
            outs.append(out)
        ref = reference_linear(x.float(), w, bias.float(), dot_dtype=torch.bfloat16)
        assert rel_err(outs[0], ref) < 1e-3, (case, m)
        assert torch.equal(outs[0], outs[1]), (case, m)


def test_dense_moe_gemv_real_size():
    """bf16 experts through the per-slot gemv at the Qwen3-30B-A3B shape (float32 math on
    exact bf16 weights: rel 1e-5 against the float32 twin)."""
    from lowbit.kernels.moe import fused_moe_gemv, reference_moe
    from lowbit.kernels.weights import resolve

    e, top, h, inter = 128, 8, 2048, 768
    w13 = resolve(torch.randn(e, 2 * inter, h, device=DEV, dtype=torch.bfloat16) * 0.02)
    w2 = resolve(torch.randn(e, h, inter, device=DEV, dtype=torch.bfloat16) * 0.02)
    for t in (1, 4, 15):
        ids = torch.rand(t, e, device=DEV).topk(top, -1).indices.to(torch.int32)
        wts = torch.rand(t, top, device=DEV)
        x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
        out = poisoned(t, h, dtype=torch.float32, device=DEV)
        fused_moe_gemv(x, ids, wts, w13, w2, out=out)
        assert rel_err(out, reference_moe(x.float(), ids, wts, w13, w2)) < 1e-5, t


def test_fused_router_in_a_graph(monkeypatch):
    """triton_gate_topk at real sizes (Qwen3 softmax top-8; DeepSeek-V3 grouped sigmoid),
    captured once and replayed on fresh activations: ids equal the reference's, except on a
    row whose choice is a near tie (the kernel's float32 gate GEMV sums in another order than
    cuBLAS): there the two choices' selection scores agree within 1e-4, and at most one row
    in 16 is one."""
    from lowbit.kernels.router_op import RouterSpec, gate_logits, reference_route, route

    monkeypatch.setenv("LOWBIT_ROUTE_ROUTER", "triton_gate_topk")
    torch.manual_seed(11)
    for e, d, spec in ((128, 2048, RouterSpec(8)),
                       (256, 7168, RouterSpec(8, "sigmoid", True, 8, 4, "top2sum", 2.5))):
        gw = torch.randn(e, d, device=DEV) * 0.05
        bias = torch.rand(e, device=DEV) * 0.1 if spec.scoring == "sigmoid" else None
        for t in (1, 16):
            x = torch.randn(t, d, device=DEV, dtype=torch.bfloat16)
            route(x, gw, None, spec, bias)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                ids, w = route(x, gw, None, spec, bias)
            for _ in range(2):
                x.copy_(torch.randn_like(x))
                graph.replay()
                logits = gate_logits(x, gw)
                want_ids, want_w = reference_route(logits, spec, bias)
                same = (ids.sort(-1).values == want_ids.sort(-1).values).all(-1)
                if not same.all():
                    sel = logits if spec.scoring == "softmax" else torch.sigmoid(logits) + bias
                    got_s = sel.gather(1, ids.long()).sum(-1)
                    want_s = sel.gather(1, want_ids.long()).sum(-1)
                    assert ((got_s - want_s).abs()[~same] <= 1e-4).all(), (e, t, got_s, want_s)
                    assert (~same).sum() <= max(1, t // 16), (e, t)
                assert torch.equal(ids[same], want_ids[same]), (e, t)
                torch.testing.assert_close(w[same], want_w[same], rtol=0, atol=1e-5)


def test_scaled_mm_route_real_size(monkeypatch):
    """torch_scaled_mm (OPT_IN): W8A8 through torch._scaled_mm's row-wise mode on the GPU,
    against the twin of the same per-token quantization; odd M pads to 16 rows."""
    from lowbit.kernels.fp8_gemm import reference_w8a8

    monkeypatch.setenv("LOWBIT_ROUTE_LINEAR", "torch_scaled_mm")
    w = make_weight("fp8_channel", 4096, 2048, seed=11, device=DEV)
    bias = torch.randn(4096, device=DEV)
    from lowbit.kernels.fp8_gemm import scaled_mm_w8a8
    from lowbit.kernels.weights import resolve

    for m in (1, 5, 16, 33):
        x = torch.randn(m, 2048, device=DEV, dtype=torch.bfloat16)
        y = linear(x, w, bias)
        assert rel_err(y, reference_w8a8(x, w, bias)) < 1e-2, m
        # the row-wise mode: the same product, the scales applied inside the GEMM
        assert rel_err(scaled_mm_w8a8(x, resolve(w), bias, mode="rowwise"), y) < 1e-2
