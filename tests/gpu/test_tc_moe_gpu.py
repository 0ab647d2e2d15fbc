"""The tensor-core nvfp4 MoE (lowbit.kernels.tc_moe) against its torch twin on a CUDA GPU:
per-slot and expert-grouped schedules, skewed routings, per-row code tables, CUDA-graph
replay, refusals. Tolerance: rel 1e-3 on float32 outputs (the twin rounds x and the
activation to bf16 where the kernels do; the nvfp4 weights are exact in both).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lowbit.kernels.samples import random_lut_view
from lowbit.kernels.weights import resolve
from tests.gpu.test_tc_gemv_gpu import NVFP4, _x
from tests.kernels.cases import guarded, poisoned, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"


def _stack(n: int, k: int, e: int, seed: int, tables: int = 1):
    v = random_lut_view(n, k, lead=(e,), seed=seed, device=DEV, tables=tables, **NVFP4)
    return resolve(dataclasses.replace(v, codes=guarded(v.codes), scales=guarded(v.scales),
                                       table=guarded(v.table), table_index=guarded(v.table_index)))


@pytest.mark.parametrize("cfg", [None, dict(BN=64, BK=128, SPLIT=3), dict(BN=64, BK=128, SPLIT=3, RING=3),
                                 dict(BN=128, BK=256, RING=4), dict(BN=16, BK=256, SPLIT=1, num_warps=1),
                                 dict(BN=32, BK=256, num_warps=2, PREFETCH=2)])
def test_tc_moe_gemv_matches_twin(cfg):
    from lowbit.kernels.moe import reference_moe
    from lowbit.kernels.tc_moe import tc_moe_gemv, tc_moe_refusal

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
    from lowbit.kernels.tc_moe import tc_moe_gemv, tc_moe_refusal

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


@pytest.mark.parametrize("t,mb,ring", [(3, 8, 0), (16, 8, 0), (64, 8, 0), (64, 16, 0), (300, 32, 0),
                                       (16, 8, 3), (64, 16, 4)])
def test_tc_moe_grouped_matches_twin(t, mb, ring):
    """Each expert read once for all its tokens: skewed routings put more than one 8-slot
    tile on an expert; per-row tables on the gate + up stack; ring: the K steps through
    the shared-memory ring (config RING)."""
    from lowbit.kernels.moe import reference_moe
    from lowbit.kernels.tc_moe import tc_moe_grouped

    e, top, h, inter = 64, 8, 2048, 768
    w13, w2 = _stack(2 * inter, h, e, seed=5, tables=2), _stack(h, inter, e, seed=6)
    g = torch.Generator(device=DEV).manual_seed(t)
    ids = torch.rand(t, e, device=DEV, generator=g).topk(top, -1).indices.to(torch.int32)
    ids[: t // 2, 0] = 5  # half the tokens share expert 5
    wts = torch.rand(t, top, device=DEV, generator=g)
    x = _x(t, h, seed=t)
    out = poisoned(t, h, dtype=torch.float32, device=DEV)
    cfg = dict(MB=mb, BK=128 if mb > 16 else 256, RING=ring)  # MB 32 spills at BK 256
    tc_moe_grouped(x, ids, wts, w13, w2, config=cfg, out=out)
    ref = reference_moe(x.float(), ids, wts, w13, w2, dot_dtype=torch.bfloat16)
    assert rel_err(out, ref) < 1e-3, (t, mb)
    y = tc_moe_grouped(x, ids, wts, w13, w2, config=cfg)  # bf16 out, and in a graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tc_moe_grouped(x, ids, wts, w13, w2, config=cfg)
    ids.copy_(torch.rand(t, e, device=DEV, generator=g).topk(top, -1).indices.to(torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_moe(x.float(), ids, wts, w13, w2, dot_dtype=torch.bfloat16)
    assert rel_err(y, ref) < 1e-2, (t, mb)


def _dead_slot_case(t: int, seed: int):
    """Qwen3-30B-A3B-like stacks (64 experts, top-8) and t tokens whose routing has a NaN row
    (token 1 names no expert) and a slot placed nowhere (token 3's third):
    (w13, w2, ids, wts, x, generator)."""
    e, top, h, inter = 64, 8, 2048, 768
    w13, w2 = _stack(2 * inter, h, e, seed=seed, tables=2), _stack(h, inter, e, seed=seed + 1)
    g = torch.Generator(device=DEV).manual_seed(t)
    ids = torch.rand(t, e, device=DEV, generator=g).topk(top, -1).indices.to(torch.int32)
    ids[1] = e
    ids[3, 2] = -1
    wts = torch.rand(t, top, device=DEV, generator=g)
    return w13, w2, ids, wts, _x(t, h, seed=t), g


@pytest.mark.parametrize("t", [5, 64])
def test_tc_moe_grouped_folded_sum_equals_combine_launch(t):
    """Config FOLD (up to 512 slots): the grouped FC2 sums each token's slots itself (its
    last-arriving program); the result equals the separate combine launch's bit for bit, including a token
    whose routing row names no expert (a NaN row: output 0) and one with a slot placed
    nowhere (summed without it), and replays in a graph as the routing changes."""
    from lowbit.kernels.moe import reference_moe
    from lowbit.kernels.tc_moe import tc_moe_grouped

    e, top, h = 64, 8, 2048
    w13, w2, ids, wts, x, g = _dead_slot_case(t, seed=7)
    folded = poisoned(t, h, dtype=torch.float32, device=DEV)
    tc_moe_grouped(x, ids, wts, w13, w2, config=dict(FOLD=True), out=folded)
    launched = poisoned(t, h, dtype=torch.float32, device=DEV)
    tc_moe_grouped(x, ids, wts, w13, w2, out=launched)
    assert torch.equal(folded, launched)
    assert torch.equal(folded[1], torch.zeros(h, device=DEV))
    keep = (ids >= 0) & (ids < e)
    ref = reference_moe(x.float(), ids.clamp(0, e - 1), wts * keep, w13, w2,
                        dot_dtype=torch.bfloat16)
    assert rel_err(folded, ref) < 1e-3
    graph = torch.cuda.CUDAGraph()
    y = torch.empty(t, h, device=DEV, dtype=torch.float32)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        tc_moe_grouped(x, ids, wts, w13, w2, config=dict(FOLD=True), out=y)
    for seed in (1, 2):
        ids.copy_(torch.rand(t, e, device=DEV).topk(top, -1).indices.to(torch.int32))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_moe(x.float(), ids, wts, w13, w2, dot_dtype=torch.bfloat16)
        assert rel_err(y, ref) < 1e-3, seed


@pytest.mark.parametrize("t", [8, 64])
def test_tc_moe_grouped_slot_sum_in_the_norm_equals_combine_launch(t):
    """defer=True: the grouped MoE returns its slot rows (SlotSum) and the next RMSNorm sums
    them in its own launch. The norm's (y, r) equal the combine launch + the add-norm bit for
    bit, with a NaN routing row and a slot placed nowhere, and in a graph as the routing
    changes."""
    from lowbit.kernels.moe_slots import SlotSum
    from lowbit.kernels.norm_op import rms_norm
    from lowbit.kernels.tc_moe import tc_moe_grouped

    e, top, h = 64, 8, 2048
    w13, w2, ids, wts, x, g = _dead_slot_case(t, seed=9)
    res = _x(t, h, seed=t + 1)
    gain = (1 + 0.1 * torch.randn(h, device=DEV, generator=g)).bfloat16()

    def both():
        slots = tc_moe_grouped(x, ids, wts, w13, w2, defer=True)
        assert isinstance(slots, SlotSum)
        fused = rms_norm(slots, gain, 1e-6, res)
        plain = rms_norm(tc_moe_grouped(x, ids, wts, w13, w2), gain, 1e-6, res)
        return fused, plain

    for (fy, fr), (py, pr) in [both()]:
        assert torch.equal(fy, py) and torch.equal(fr, pr)
        assert torch.isfinite(fy).all()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (fy, fr), (py, pr) = both()
    for _ in range(2):
        ids.copy_(torch.rand(t, e, device=DEV, generator=g).topk(top, -1).indices.to(torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(fy, py) and torch.equal(fr, pr)


@pytest.mark.parametrize("t", [1, 4, 64])
def test_ring_gives_the_register_loops_bits(t):
    """Config RING changes where a K step's bytes wait (shared memory, by cp.async), not the
    order of the sums: the per-slot MoE (t = 1, 4) and the expert-grouped one (t = 64, with a
    NaN routing row and a slot placed nowhere) give the register loop's output bit for bit,
    and in a graph replayed as the routing changes."""
    from lowbit.kernels.tc_moe import tc_moe_gemv, tc_moe_grouped

    e, top, h = 64, 8, 2048
    w13, w2, ids, wts, x, g = _dead_slot_case(max(t, 4), seed=11)  # rows 1 and 3 are dead
    if t < 8:  # the per-slot kernels take routable ids only
        wts, x = wts[:t], x[:t]
        ids = torch.rand(t, e, device=DEV, generator=g).topk(top, -1).indices.to(torch.int32)
        def run(cfg, out):
            tc_moe_gemv(x, ids, wts, w13, w2, config=dict(fc1=cfg, fc2=cfg), out=out)
        base = dict(BN=64, BK=256, SPLIT=2)
    else:
        def run(cfg, out):
            tc_moe_grouped(x, ids, wts, w13, w2, config=cfg, out=out)
        base = dict(MB=16)
    outs = {}
    for ring in (0, 3, 4):
        outs[ring] = poisoned(t, h, dtype=torch.float32, device=DEV)
        run(dict(base, RING=ring), outs[ring])
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[3], outs[0]) and torch.equal(outs[4], outs[0])
    y0, y4 = (torch.empty(t, h, device=DEV) for _ in range(2))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(dict(base, RING=0), y0)
        run(dict(base, RING=4), y4)
    for _ in range(2):
        ids.copy_(torch.rand(t, e, device=DEV, generator=g).topk(top, -1).indices.to(torch.int32))
        y4.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y4, y0)
