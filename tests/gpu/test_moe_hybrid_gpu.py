"""Hybrid MoE layouts and the grouped route on a CUDA GPU: real sizes against the twins,
CUDA-graph capture and replay with no host sync. Skipped (marked) without CUDA.

Tolerances: float32 outputs; the tile kernels round x, w and h to bf16 where the twin does
(dot_dtype), so only summation order differs (rel 1e-3).
"""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.moe import fused_moe, reference_moe
from lowbit.kernels.moe_hybrid import fused_moe_hybrid, reference_hybrid
from lowbit.kernels.moe_layout import hybrid_experts, make_group, shared_group, with_shared_slots
from tests.kernels.cases import make_weight, poisoned, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"


def _group(case, n, h, inter, seed):
    return make_group(make_weight(case, 2 * inter, h, lead=(n,), seed=seed, device=DEV),
                      make_weight(case, h, inter, lead=(n,), seed=seed + 1, device=DEV))


def _ids(t, e, a, seed, hot=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = torch.rand(t, e, device=DEV, generator=g)
    if hot:
        r[:, :hot] += 1.0
    return r.topk(a, -1).indices.to(torch.int32), torch.rand(t, a, device=DEV, generator=g)


@pytest.mark.parametrize("mode", ["decode", "grouped"])
def test_hybrid_nvfp4_nf3_real_size(mode):
    e, hot, h, inter = 64, 8, 2048, 768
    layout = hybrid_experts([_group("nvfp4_two_tables", hot, h, inter, 1), _group("nf3", e - hot, h, inter, 3)],
                            [list(range(hot)), list(range(hot, e))])
    for t in ((1, 4, 16) if mode == "decode" else (1, 33, 129)):
        ids, w = _ids(t, e, 8, seed=t, hot=hot // 2)
        x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
        out = poisoned(t, h, dtype=torch.float32, device=DEV)
        fused_moe_hybrid(x, ids, w, layout, mode=mode, out=out)
        ref = reference_hybrid(x.float(), ids, w, layout, dot_dtype=torch.bfloat16)
        assert rel_err(out, ref) < 1e-3, (mode, t)


def test_shared_expert_slot_real_size():
    e, h, inter = 32, 2048, 512  # DeepSeek-like proportions, smaller E
    w13 = make_weight("nvfp4_two_tables", 2 * inter, h, lead=(e,), seed=1, device=DEV)
    w2 = make_weight("nvfp4_two_tables", h, inter, lead=(e,), seed=2, device=DEV)
    parts = [make_weight("nvfp4_two_tables", n, k, seed=5 + i, device=DEV)
             for i, (n, k) in enumerate(((inter, h), (inter, h), (h, inter)))]
    layout = hybrid_experts([make_group(w13, w2), shared_group(*parts, 1)], [list(range(e)), [e]])
    ids, w = _ids(4, e, 8, seed=3)
    x = torch.randn(4, h, device=DEV, dtype=torch.bfloat16)
    i2, w2s = with_shared_slots(ids, w, e, 1)
    out = poisoned(4, h, dtype=torch.float32, device=DEV)
    fused_moe_hybrid(x, i2, w2s, layout, out=out)
    assert rel_err(out, reference_hybrid(x.float(), i2, w2s, layout, dot_dtype=torch.bfloat16)) < 1e-3


@pytest.mark.parametrize("which", ["grouped", "hybrid_decode", "hybrid_grouped"])
def test_graph_capture_without_sync(which):
    """The grouped route (device sort and histogram) and the hybrid launches replay in a CUDA
    graph; capture runs under sync debug mode "error", so any host read fails the test."""
    e, h, inter, t = 16, 1024, 256, 24 if which != "hybrid_decode" else 4
    w13 = make_weight("nvfp4_two_tables", 2 * inter, h, lead=(e,), seed=1, device=DEV)
    w2 = make_weight("nvfp4_two_tables", h, inter, lead=(e,), seed=2, device=DEV)
    layout = hybrid_experts([make_group(w13, w2)], [list(range(e))])
    ids, w = _ids(t, e, 4, seed=7)
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(t, h, device=DEV, dtype=torch.float32)
    if which == "grouped":
        def fn():
            fused_moe(x, ids, w, w13, w2, mode="grouped", out=out)
    else:
        def fn():
            fused_moe_hybrid(x, ids, w, layout, mode=which.split("_")[1], out=out)
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ids.copy_(_ids(t, e, 4, seed=8)[0])  # new routing, same buffers
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_moe(x.float(), ids, w, w13, w2, dot_dtype=torch.bfloat16)
    assert rel_err(out, ref) < 1e-3
