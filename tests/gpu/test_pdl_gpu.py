"""Programmatic dependent launch on a CUDA GPU: a chain of decode-layer kernels (RMSNorm with
residual, tensor-core gemv, paged decode attention with splits, router, per-slot and grouped
tensor-core MoE), captured in a CUDA graph with PDL on, gives the same bits as the same chain
run eagerly with PDL off. A kernel that read its input before `griddepcontrol.wait` would
read the previous replay's or a half-written value here: every layer's input is the last
layer's fresh output, and the inputs change between replays."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels import launch
from tests.gpu.test_tc_gemv_gpu import _weight, _x
from tests.gpu.test_tc_moe_gpu import _stack

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"


def _set_pdl(monkeypatch, on: bool) -> None:
    monkeypatch.setenv("LOWBIT_PDL", "1" if on else "0")
    launch.clear_cache()


def _chain(x, p):
    """L layers: r = x + r; h = RMSNorm(r); a = paged attention of q = W_q h; x = W_o a;
    h = RMSNorm(x + r); routed MoE of h (per slot or grouped by T); x = that."""
    from lowbit.kernels import attention, norm_op, router_op, tc_moe
    from lowbit.kernels.tc_gemv import tc_gemv

    r = torch.zeros_like(x)
    t = x.shape[0]
    for wq, wo, gw, w13, w2 in p["layers"]:
        h, r = norm_op.rms_norm(x, p["g"], 1e-6, r)
        q = tc_gemv(h, wq).view(t, 16, 128)
        a = attention.paged_decode(q, p["pool"], p["tables"], p["lens"], 0.088, num_splits=4)
        x = tc_gemv(a.view(t, -1), wo)
        h, r = norm_op.rms_norm(x, p["g"], 1e-6, r)
        ids, wts = router_op.route(h, gw, None, router_op.RouterSpec(top_k=4))
        moe = tc_moe.tc_moe_grouped if t >= 8 else tc_moe.tc_moe_gemv
        x = moe(h, ids, wts, w13, w2)
    return x + r


def _params(layers: int) -> dict:
    d, e, inter = 2048, 32, 512
    ls = []
    for i in range(layers):
        ls.append((_weight(2048, d, seed=10 * i + 1), _weight(d, 2048, seed=10 * i + 2),
                   torch.randn(e, d, device=DEV) * 0.05, _stack(2 * inter, d, e, seed=10 * i + 3),
                   _stack(d, inter, e, seed=10 * i + 4)))
    pool = attention_pool()
    return {"layers": ls, "g": torch.rand(d, device=DEV).bfloat16() + 0.5, "pool": pool}


def attention_pool():
    from lowbit.kernels.attention import KVPool

    k = torch.randn(4096, 16, 128, device=DEV).bfloat16()
    return KVPool(k, torch.randn_like(k), 16)


@pytest.mark.parametrize("t", [1, 16])
def test_pdl_chain_in_a_graph_matches_eager_without_pdl(monkeypatch, t):
    p = _params(layers=6)
    p["tables"] = torch.randperm(256, device=DEV)[: t * 16].view(t, 16).to(torch.int32)
    p["lens"] = torch.randint(1, 256, (t,), device=DEV, dtype=torch.int32)
    x = _x(t, 2048, seed=t)
    try:
        _set_pdl(monkeypatch, True)
        assert launch.pdl_args(x) == {"PDL": True, "launch_pdl": True}
        _chain(x, p)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = _chain(x, p)
        outs = []
        for seed in (1, 2, 3):
            x.copy_(_x(t, 2048, seed=seed))
            p["lens"].copy_(torch.randint(1, 256, (t,), device=DEV, dtype=torch.int32))
            graph.replay()
            torch.cuda.synchronize()
            outs.append((x.clone(), p["lens"].clone(), y.clone()))
        _set_pdl(monkeypatch, False)
        assert launch.pdl_args(x) == {"PDL": False}
        for xin, lens, got in outs:
            x.copy_(xin)
            p["lens"].copy_(lens)
            want = _chain(x, p)
            assert torch.isfinite(want).all()
            assert torch.equal(got, want)
    finally:
        launch.clear_cache()
