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
