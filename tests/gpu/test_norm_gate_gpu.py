"""The one-launch post-attention norm + gate GEMV (lowbit.kernels.norm_gate_op) on a CUDA GPU:
against the norm op and the float32 gate GEMM at the Qwen3-30B-A3B shape and odd ones, with
NaN guards around the inputs, eagerly and replayed in a CUDA graph with fresh inputs."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels import norm_gate_op, norm_op
from lowbit.kernels.router_op import gate_logits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"
EPS = 1e-6


def _guarded(t: torch.Tensor) -> torch.Tensor:
    """t in the middle of a NaN-filled buffer (a read past either end shows)."""
    flat = torch.full((t.numel() + 256,), float("nan"), dtype=t.dtype, device=DEV)
    flat[128:128 + t.numel()] = t.reshape(-1)
    return flat[128:128 + t.numel()].view(t.shape)


def _data(T, D, E, seed, bias=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = _guarded((torch.randn(T, D, device=DEV, generator=g) * 3).to(torch.bfloat16))
    res = _guarded(torch.randn(T, D, device=DEV, generator=g).to(torch.bfloat16))
    w = _guarded((1 + 0.2 * torch.randn(D, device=DEV, generator=g)).to(torch.bfloat16))
    gw = _guarded(torch.randn(E, D, device=DEV, generator=g) / D**0.5)
    gb = _guarded(torch.randn(E, device=DEV, generator=g)) if bias else None
    return x, w, res, gw, gb


def _check(x, w, res, gw, gb, got):
    y, r, logits = got[:3]
    want_y, want_r = norm_op.rms_norm(x, w, EPS, res)
    assert torch.equal(r, want_r)
    diff = (y.float() - want_y.float()).abs()
    assert torch.isfinite(y).all() and (diff <= 2 * 2**-7 * want_y.float().abs()).all()
    assert (y != want_y).float().mean().item() < 0.01  # the sum of squares' order, rarely
    torch.testing.assert_close(logits, gate_logits(y, gw, gb), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T,D,E,bias", [(1, 2048, 128, False), (8, 2048, 128, False),
                                        (16, 2880, 32, True), (3, 7168, 256, False)])
def test_norm_gate_matches_the_norm_and_the_gate(T, D, E, bias):
    x, w, res, gw, gb = _data(T, D, E, seed=T + D, bias=bias)
    call = norm_gate_op.NormGateCall(x, w, EPS, res, gw, gb)
    assert norm_gate_op._admit_triton(call) is None
    _check(x, w, res, gw, gb, norm_gate_op._run_triton(call))


def test_norm_gate_replays_in_a_graph_with_fresh_inputs():
    x, w, res, gw, gb = _data(1, 2048, 128, seed=7)
    call = norm_gate_op.NormGateCall(x, w, EPS, res, gw, gb)
    norm_gate_op._run_triton(call)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = norm_gate_op._run_triton(call)
    for seed in (8, 9):
        x2, _, res2, _, _ = _data(1, 2048, 128, seed=seed)
        x.copy_(x2)
        res.copy_(res2)
        graph.replay()
        torch.cuda.synchronize()
        _check(x, w, res, gw, gb, out)


@pytest.mark.parametrize("T", [1, 8, 16])
def test_norm_route_ranks_as_the_router_does(T):
    """triton_norm_route: the norm and logits as above, and the ids / weights the router's
    reference picks from those logits; twice in a row (the block counters reset)."""
    from lowbit.kernels.router_op import RouterSpec, reference_route

    spec = RouterSpec(top_k=8)
    x, w, res, gw, gb = _data(T, 2048, 128, seed=40 + T)
    call = norm_gate_op.NormGateCall(x, w, EPS, res, gw, gb, spec)
    assert norm_gate_op._admit_route(call) is None
    for _ in range(2):
        got = norm_gate_op._run_route(call)
        _check(x, w, res, gw, gb, got)
        ids, wts = reference_route(got[2], spec)
        assert torch.equal(got[3], ids)
        torch.testing.assert_close(got[4], wts, rtol=1e-5, atol=1e-6)
