"""The tensor-core nvfp4 GEMV (lowbit.kernels.tc_gemv) against its torch twin on a CUDA GPU:
real and odd shapes, every M to 16, split-K determinism, CUDA-graph replay, refusals.

The twin decodes the same exact weights (e2m1 * scale * alpha * g) and multiplies in float32;
the kernel's bf16 products are exact and only the float32 summation order differs (rel 1e-4
on float32 outputs).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lowbit.kernels.samples import random_lut_view
from lowbit.kernels.weights import resolve
from tests.kernels.cases import guarded, poisoned, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"
NVFP4 = dict(bits=4, table="e2m1", block_size=16, scale_kind="e4m3")


def _weight(n: int, k: int, seed: int, **kw):
    v = random_lut_view(n, k, seed=seed, device=DEV, **{**NVFP4, **kw})
    return resolve(dataclasses.replace(v, codes=guarded(v.codes), scales=guarded(v.scales),
                                       table=guarded(v.table), table_index=guarded(v.table_index)))


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("n,k,tables", [(4096, 4096, 1), (2048, 768, 2), (1030, 384, 3)])
def test_tc_gemv_matches_twin(n, k, tables):
    """tables > 1: per-row code tables, as merged projections (QKV, gate + up) have."""
    from lowbit.kernels.dequant_gemm import reference_linear
    from lowbit.kernels.tc_gemv import tc_gemv

    w = _weight(n, k, seed=n + k, tables=tables)
    bias = torch.randn(n, device=DEV)
    for m in (1, 2, 5, 8, 9, 16):
        x = _x(m, k, seed=m)
        for cfg in (None, dict(BN=64, BK=128, SPLIT=3), dict(BN=128, BK=256, SPLIT=1)):
            out = poisoned(m, n, dtype=torch.float32, device=DEV)
            tc_gemv(x, w, bias, config=cfg, out=out)
            assert rel_err(out, reference_linear(x.float(), w, bias)) < 1e-4, (n, k, m, cfg)
    y = tc_gemv(x, w)  # bf16 output: one rounding of the float32 result
    assert y.dtype == torch.bfloat16
    assert rel_err(y, reference_linear(x.float(), w)) < 1e-2


def test_tc_gemv_split_k_is_deterministic():
    from lowbit.kernels.tc_gemv import tc_gemv

    w = _weight(4096, 14336, seed=6)
    x = _x(3, 14336, seed=6)
    outs = []
    for _ in range(3):
        out = poisoned(3, 4096, dtype=torch.float32, device=DEV)
        tc_gemv(x, w, config=dict(BN=64, BK=256, SPLIT=7), out=out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


def test_tc_gemv_graph_replay():
    from lowbit.kernels.dequant_gemm import reference_linear
    from lowbit.kernels.tc_gemv import tc_gemv

    w = _weight(2048, 4096, seed=9)
    x = _x(4, 4096, seed=1)
    y = torch.empty(4, 2048, device=DEV, dtype=torch.float32)
    tc_gemv(x, w, out=y)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tc_gemv(x, w, out=y)
    for seed in (2, 3):
        x.copy_(_x(4, 4096, seed=seed))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, reference_linear(x.float(), w)) < 1e-4, seed


def test_tc_gemv_refusals():
    from lowbit.kernels.tc_gemv import tc_gemv_refusal

    w = _weight(256, 512, seed=1)
    assert tc_gemv_refusal(_x(1, 512, 0), w) is None
    assert "M = 17" in tc_gemv_refusal(_x(17, 512, 0), w)
    assert "bf16" in tc_gemv_refusal(_x(1, 512, 0).half(), w)
    assert "multiple of 128" in tc_gemv_refusal(_x(1, 400, 0), _weight(256, 400, seed=1))
    int4 = resolve(random_lut_view(256, 512, bits=4, table="int", block_size=32, scale_kind="f16",
                                   device=DEV))
    assert "nvfp4 only" in tc_gemv_refusal(_x(1, 512, 0), int4)


def _stack(n: int, k: int, e: int, seed: int, tables: int = 1):
    v = random_lut_view(n, k, lead=(e,), seed=seed, device=DEV, tables=tables, **NVFP4)
    return resolve(dataclasses.replace(v, codes=guarded(v.codes), scales=guarded(v.scales),
                                       table=guarded(v.table), table_index=guarded(v.table_index)))


@pytest.mark.parametrize("cfg", [None, dict(BN=64, BK=128, SPLIT=3)])
def test_tc_moe_gemv_matches_twin(cfg):
    from lowbit.kernels.moe import reference_moe
    from lowbit.kernels.tc_gemv import tc_moe_gemv, tc_moe_refusal

    e, top, h, inter = 64, 8, 2048, 768
    w13, w2 = _stack(2 * inter, h, e, seed=1, tables=2), _stack(h, inter, e, seed=2)
    for t in (1, 3, 16):
        g = torch.Generator(device=DEV).manual_seed(t)
        ids = torch.rand(t, e, device=DEV, generator=g).topk(top, -1).indices.to(torch.int32)
        ids[: t // 2, 0] = 5  # skewed: half the tokens share one expert
        wts = torch.rand(t, top, device=DEV, generator=g)
        x = _x(t, h, seed=t)
        assert tc_moe_refusal(x, w13, w2) is None
        out = poisoned(t, h, dtype=torch.float32, device=DEV)
        conf = None if cfg is None else dict(fc1=cfg, fc2=cfg)
        tc_moe_gemv(x, ids, wts, w13, w2, config=conf, out=out)
        ref = reference_moe(x.float(), ids, wts, w13, w2, dot_dtype=torch.bfloat16)
        assert rel_err(out, ref) < 1e-3, (t, cfg)


def test_tc_moe_gemv_graph_replay_and_refusals():
    from lowbit.kernels.moe import reference_moe
    from lowbit.kernels.moe_op import MoeActivation
    from lowbit.kernels.tc_gemv import tc_moe_gemv, tc_moe_refusal

    e, top, h, inter = 16, 4, 1024, 512
    w13, w2 = _stack(2 * inter, h, e, seed=3), _stack(h, inter, e, seed=4)
    x = _x(2, h, seed=0)
    ids = torch.tensor([[0, 3, 5, 7], [3, 1, 0, 15]], device=DEV, dtype=torch.int32)
    wts = torch.rand(2, top, device=DEV)
    y = torch.empty(2, h, device=DEV, dtype=torch.float32)
    tc_moe_gemv(x, ids, wts, w13, w2, out=y)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tc_moe_gemv(x, ids, wts, w13, w2, out=y)
    for seed in (1, 2):
        x.copy_(_x(2, h, seed=seed))
        ids.copy_(torch.rand(2, e, device=DEV).topk(top, -1).indices.to(torch.int32))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_moe(x.float(), ids, wts, w13, w2, dot_dtype=torch.bfloat16)
        assert rel_err(y, ref) < 1e-3, seed
    assert "SiLU only" in tc_moe_refusal(x, w13, w2, activation=MoeActivation("swiglu_oai", limit=7.0))
    assert "biases" in tc_moe_refusal(x, w13, w2, b13=torch.zeros(e, 2 * inter, device=DEV))


@pytest.mark.parametrize("t", [3, 16, 64])
def test_tc_moe_grouped_matches_twin(t):
    """Each expert read once for all its tokens: skewed routings put more than one 8-slot
    tile on an expert; per-row tables on the gate + up stack."""
    from lowbit.kernels.moe import reference_moe
    from lowbit.kernels.tc_gemv import tc_moe_grouped

    e, top, h, inter = 64, 8, 2048, 768
    w13, w2 = _stack(2 * inter, h, e, seed=5, tables=2), _stack(h, inter, e, seed=6)
    g = torch.Generator(device=DEV).manual_seed(t)
    ids = torch.rand(t, e, device=DEV, generator=g).topk(top, -1).indices.to(torch.int32)
    ids[: t // 2, 0] = 5  # half the tokens share expert 5
    wts = torch.rand(t, top, device=DEV, generator=g)
    x = _x(t, h, seed=t)
    out = poisoned(t, h, dtype=torch.float32, device=DEV)
    tc_moe_grouped(x, ids, wts, w13, w2, out=out)
    ref = reference_moe(x.float(), ids, wts, w13, w2, dot_dtype=torch.bfloat16)
    assert rel_err(out, ref) < 1e-3, t
    y = tc_moe_grouped(x, ids, wts, w13, w2)  # bf16 out, and in a graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tc_moe_grouped(x, ids, wts, w13, w2)
    ids.copy_(torch.rand(t, e, device=DEV, generator=g).topk(top, -1).indices.to(torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_moe(x.float(), ids, wts, w13, w2, dot_dtype=torch.bfloat16)
    assert rel_err(y, ref) < 1e-2, t
