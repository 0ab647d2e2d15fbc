"""The vector codebook gemv on a CUDA GPU at real sizes, against its torch twin, and the
linear door forcing it. Skipped (marked) without CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lowbit.formats import get_format
from lowbit.kernels import linear
from lowbit.kernels.vq_gemv import reference_vq_linear, vq_gemv
from lowbit.kernels.weights import resolve
from tests.kernels.cases import guarded, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("name", ["vq2", "vq3", "vq4"])
@pytest.mark.parametrize("n,k", [(4096, 4096), (2048, 6144), (1000, 1000)])
def test_vq_gemv_real_size(name, n, k):
    w = torch.randn(n, k, device="cuda") * 0.02
    vw = resolve(get_format(name).quantize(w))
    vw = dataclasses.replace(vw, codes=guarded(vw.codes), scales=guarded(vw.scales))
    bias = torch.randn(n, device="cuda")
    for m in (1, 3, 16):
        x = torch.randn(m, k, device="cuda")
        out = torch.full((m, n), float("nan"), device="cuda")
        vq_gemv(x, vw, bias, out=out)
        assert rel_err(out, reference_vq_linear(x, vw, bias)) < 1e-5, (name, m)


def test_linear_door_forces_the_vq_route(monkeypatch):
    qt = get_format("vq3").quantize(torch.randn(512, 768, device="cuda") * 0.02)
    x = torch.randn(2, 768, device="cuda", dtype=torch.bfloat16)
    monkeypatch.delenv("LOWBIT_ROUTE_LINEAR", raising=False)
    ref = linear(x, qt)  # OPT_IN: the torch route serves it by default
    monkeypatch.setenv("LOWBIT_ROUTE_LINEAR", "triton_vq_gemv")
    assert rel_err(linear(x, qt), ref) < 1e-2


@pytest.mark.parametrize("fc1,fc2", [("vq3", "vq4"), ("vq2", "vq3")])
def test_vq_moe_qwen3_shape(fc1, fc2):
    """The per-slot vq MoE at the Qwen3-30B-A3B expert shape (128 experts, H 2048, I 768,
    top-8) against the twin at T = 1, 4, 16, then replayed from a CUDA graph on new routing."""
    from lowbit.kernels.moe import reference_moe
    from lowbit.kernels.vq_moe import vq_moe

    e, h, inter, a = 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = resolve(get_format(fc1).quantize(torch.randn(e, 2 * inter, h, device="cuda", generator=g) * 0.02))
    w2 = resolve(get_format(fc2).quantize(torch.randn(e, h, inter, device="cuda", generator=g) * 0.02))
    for t in (1, 4, 16):
        x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:a] for _ in range(t)]).int()
        w = torch.rand(t, a, device="cuda", generator=g)
        out = torch.full((t, h), float("nan"), device="cuda", dtype=torch.bfloat16)
        vq_moe(x, ids, w, w13, w2, out=out)
        assert rel_err(out, reference_moe(x, ids, w, w13, w2)) < 1e-2, t
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        vq_moe(x, ids, w, w13, w2, out=out)
    ids.copy_(torch.stack([torch.randperm(e, device="cuda", generator=g)[:a] for _ in range(16)]).int())
    out.fill_(float("nan"))
    graph.replay()
    assert rel_err(out, reference_moe(x, ids, w, w13, w2)) < 1e-2
