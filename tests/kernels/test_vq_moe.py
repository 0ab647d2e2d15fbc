"""The vector codebook MoE decode kernels (lowbit/kernels/vq_moe.py) against the MoE twin,
in the Triton interpreter, on fresh random stacks between NaN guards, and through the moe
op's door (route `triton_vq_moe`)."""

from __future__ import annotations

import pytest
import torch

from lowbit.formats import get_format
from lowbit.kernels import routes
from lowbit.kernels.moe import reference_moe
from lowbit.kernels.moe_op import moe_experts
from lowbit.kernels.vq_moe import VQ_MOE_MAX_TOKENS, vq_moe
from lowbit.kernels.weights import resolve
from tests.kernels.cases import rel_err
from tests.kernels.test_vq_gemv import GEOMETRIES, random_vq

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small ops: one thread (conftest)

E = 5


def routing(t: int, a: int, seed: int, nowhere: bool = False):
    """ids [T, A] int32 of distinct experts per token and positive weights; with nowhere,
    the last slot of token 0 is placed nowhere (id -1, weight 0, as an expert cache masks)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:a] for _ in range(t)]).to(torch.int32)
    w = torch.rand(t, a, generator=g) + 0.1
    if nowhere:
        ids[0, -1], w[0, -1] = -1, 0.0
    return ids, w


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("fc1,fc2", [("d4_ib8", "d2_ib8"), ("d4_ib12", "d4_ib12"), ("d2_ib8", "d4_ib12")])
@pytest.mark.parametrize("t,h,inter,bb", [(1, 64, 32, 4), (3, 100, 48, 1), (4, 70, 33, 2), (2, 128, 64, 2)])
def test_vq_moe_matches_twin(fc1, fc2, t, h, inter, bb, packed):
    """Float32 codebook gathers, and the packed codebooks (float16 entries) of the shipped
    formats through the block kernels: masked steps, and EVEN ones (H 128, I 64, BB 2)."""
    (d1, b1), (d2, b2) = GEOMETRIES[fc1], GEOMETRIES[fc2]
    w13 = random_vq(2 * inter, h, d1, b1, seed=t * 100 + h, lead=(E,), packed=packed)
    w2 = random_vq(h, inter, d2, b2, seed=t * 100 + inter + 1, lead=(E,), packed=packed)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(h)) * 0.5
    ids, w = routing(t, 2, seed=t + h, nowhere=t > 1)
    out = torch.full((t, h), float("nan"))
    y = vq_moe(x, ids, w, w13, w2, config={"BN": 16, "BG": 8, "BB": bb}, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert rel_err(y, reference_moe(x, ids, w, w13, w2)) < 1e-5


def test_vq_moe_bf16_activations_and_float32_out():
    w13 = random_vq(64, 96, 4, 12, seed=5, lead=(E,))
    w2 = random_vq(96, 32, 2, 8, seed=6, lead=(E,))
    x = torch.randn(2, 96).bfloat16()
    ids, w = routing(2, 3, seed=7)
    y = vq_moe(x, ids, w, w13, w2)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, reference_moe(x, ids, w, w13, w2)) < 1e-2
    out = torch.full((2, 96), float("nan"))
    vq_moe(x, ids, w, w13, w2, out=out)  # float32 out keeps the sum unrounded
    assert rel_err(out, reference_moe(x.float(), ids, w, w13, w2)) < 1e-5


def test_vq_moe_refusals():
    w13 = random_vq(64, 96, 4, 8, seed=1, lead=(E,))
    w2 = random_vq(96, 32, 4, 8, seed=2, lead=(E,))
    x = torch.randn(2, 96)
    ids, w = routing(2, 2, seed=3)
    with pytest.raises(ValueError, match="not a stack of experts"):
        vq_moe(x, ids, w, random_vq(64, 96, 4, 8, seed=1), w2)
    with pytest.raises(ValueError, match="shapes disagree"):
        vq_moe(torch.randn(2, 80), ids, w, w13, w2)
    many = torch.zeros(VQ_MOE_MAX_TOKENS + 1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="per-slot vq kernels take"):
        vq_moe(torch.randn(VQ_MOE_MAX_TOKENS + 1, 96), many, many.float(), w13, w2)


def test_moe_op_runs_vq_stacks_through_the_route_when_forced(monkeypatch):
    """Quantized vq3 / vq4 stacks through moe_experts: the forced route gives the twin's
    output; unforced on the CPU, and for biases, the route refuses and torch runs."""
    g = torch.Generator().manual_seed(0)
    w13 = get_format("vq3").quantize(torch.randn(E, 64, 96, generator=g) * 0.05)
    w2 = get_format("vq4").quantize(torch.randn(E, 96, 32, generator=g) * 0.05)
    x = torch.randn(3, 96, generator=g)
    ids, w = routing(3, 2, seed=9)
    want = reference_moe(x, ids, w, resolve(w13), resolve(w2))
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "triton_vq_moe")
    routes.reset_counters()
    y = moe_experts(x, ids, w, w13, w2)
    ran = {c["route"] for c in routes.counters()["route_calls"] if c["op"] == "moe"}
    assert ran == {"triton_vq_moe"}
    assert rel_err(y, want) < 1e-5
    route = {r.name: r for r in routes.ops()["moe"].routes}["triton_vq_moe"]
    assert route.status == routes.OPT_IN
    monkeypatch.delenv("LOWBIT_ROUTE_MOE")
    routes.reset_counters()
    y = moe_experts(x, ids, w, w13, w2)
    ran = {c["route"] for c in routes.counters()["route_calls"] if c["op"] == "moe"}
    assert ran == {"torch"}
    assert rel_err(y, want) < 1e-5
