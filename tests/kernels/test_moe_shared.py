"""The moe op with DeepSeek-style shared experts (`shared=` a SharedMLP).

The `triton_moe_shared_slots` route (forced here: the interpreter on the CPU) appends the
shared MLP as extra always-selected expert slots of the routed launch; its output must
match the routed experts + a separate shared GatedMLP on the same quantized weights. When
it refuses, its reason is counted and the next route runs the two one after the other.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.errors import LowbitError  # noqa: E402
from lowbit.formats import get_format  # noqa: E402
from lowbit.kernels import routes  # noqa: E402
from lowbit.kernels.moe_layout import SharedMLP  # noqa: E402
from lowbit.kernels.runtime import interpreting  # noqa: E402
from lowbit.layers.moe import RouterSpec, SparseMoE, route  # noqa: E402
from tests.kernels.cases import rel_err  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")
D, E, INTER = 64, 6, 64  # INTER: whole nf3 blocks (64), so a shared width splits into experts
LAYER = "model.layers.0.mlp.experts"


def _block(fmt: str, n_shared: int, dense_down: bool = False) -> SparseMoE:
    torch.manual_seed(0)
    moe = SparseMoE(D, E, INTER, RouterSpec(top_k=2), "model.layers.0.mlp", shared_inter=n_shared * INTER)
    f = get_format(fmt)
    moe.gate.weight.data.normal_(0, 0.5)
    for name in ("w13", "w2"):
        p = getattr(moe.experts, name)
        moe.experts.set_quantized_weight(name, f.quantize(torch.randn(p.shape) * 0.1))
    sh = moe.shared_experts
    sh.down_proj.weight.data.normal_(0, 0.1)
    for lin in (sh.gate_proj, sh.up_proj) + (() if dense_down else (sh.down_proj,)):
        lin.set_quantized_weight(f.quantize(torch.randn(lin.weight.shape) * 0.1))
    return moe


def _moe_routes() -> list[str]:
    return [c["route"] for c in routes.counters()["route_calls"] if c["op"] == "moe"]


@pytest.mark.parametrize("fmt,n_shared", [("nvfp4", 1), ("nf3", 2)])
def test_shared_experts_fused(monkeypatch, fmt, n_shared):
    moe = _block(fmt, n_shared)
    x = torch.randn(3, D)
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "torch")
    unfused = moe(x)  # the torch route: routed experts, then the shared MLP separately
    assert moe.shared._fused is None  # the torch route never builds the layout
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "triton_moe_shared_slots")
    monkeypatch.setenv("LOWBIT_ROUTE_LINEAR", "torch")
    routes.reset_counters()
    fused = moe(x)
    assert _moe_routes() == ["triton_moe_shared_slots"]
    layout = moe.shared._fused[1]
    assert layout.num_experts == E + n_shared and len(layout.groups) == 2
    assert rel_err(fused, unfused) < 3e-2  # bf16 tensor-core operands vs float32 throughout
    moe(x)
    assert moe.shared._fused[1] is layout  # made once, kept on the block


def test_unfused_block_adds_the_shared_mlp_and_counts_why(monkeypatch):
    moe = _block("nvfp4", 1)
    x = torch.randn(3, D)
    monkeypatch.delenv("LOWBIT_ROUTE_MOE", raising=False)
    routes.reset_counters()
    y = moe(x)  # auto: the shared route is MEASURED_NEGATIVE, the torch route runs both
    assert _moe_routes() == ["torch"]
    shared_route = routes.ops()["moe"].get("triton_moe_shared_slots")
    assert shared_route.status == routes.MEASURED_NEGATIVE
    ids, w = route(x, moe.gate.weight.float(), None, moe.spec, None)
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "torch")
    routed = moe.experts(x, ids, w)  # no shared experts passed: routed only
    torch.testing.assert_close(y, routed + moe.shared_experts(x), rtol=0, atol=0)


def test_a_block_that_cannot_fuse_says_why(monkeypatch):
    moe = _block("nvfp4", 1, dense_down=True)
    dense = moe.shared_experts.down_proj
    x = torch.randn(2, D)
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "triton_moe_shared_slots")
    with pytest.raises(LowbitError, match="shared expert weight must be a 2D LUT weight"):
        moe(x)
    # the layout follows the weights: quantizing the dense one lets the block fuse
    dense.set_quantized_weight(get_format("nvfp4").quantize(torch.randn(D, INTER) * 0.1))
    monkeypatch.setenv("LOWBIT_ROUTE_LINEAR", "torch")
    moe(x)
    assert moe.shared._fused[0][4] is dense.weight


DENSE_E = 16  # slots < 2 E up to 5 tokens x (top-2 + 3 shared): the decode route's gemv


def _dense_block(n_shared: int, inter: int) -> SparseMoE:
    """A DeepSeek MoE block in bf16 (make_mlp: the shared MLP is a GateUpMLP), its weights
    random and its merged gate_up made as at serving (prepare_for_serving), the merged
    weight and the down projection moved between NaN guards."""
    from lowbit.models.deepseek_v3 import GateUpMLP
    from tests.kernels.cases import guarded

    torch.manual_seed(n_shared)
    moe = SparseMoE(D, DENSE_E, inter, RouterSpec(top_k=2), "model.layers.0.mlp", shared_inter=n_shared * inter)
    moe.shared_experts = GateUpMLP(D, n_shared * inter, "model.layers.0.mlp.shared_experts")
    moe.shared = SharedMLP(moe.shared_experts)
    moe.gate.weight.data.normal_(0, 0.5)
    for p in (moe.experts.w13, moe.experts.w2):
        p.data = guarded((torch.randn(p.shape) * 0.1).bfloat16())
    sh = moe.shared_experts
    for lin in (sh.gate_proj, sh.up_proj, sh.down_proj):
        lin.weight.data = (torch.randn(lin.weight.shape) * 0.1).bfloat16()
    sh.prepare_for_serving()
    sh.gate_up_proj.weight.data = guarded(sh.gate_up_proj.weight.data)
    sh.down_proj.weight.data = guarded(sh.down_proj.weight.data)
    return moe


@pytest.mark.parametrize("n_shared,inter,t", [(1, 48, 1), (2, 40, 3), (2, 64, 5), (3, 24, 2)])
def test_dense_shared_experts_ride_in_the_routed_gemv(monkeypatch, n_shared, inter, t):
    """bf16 experts: triton_moe_dense_shared runs the shared MLP as n_shared more gemv slots
    of each token (no shared GEMM, SiLU-mul or add), and matches the torch route (routed
    experts, then the separate shared MLP, float32) on fresh random data over odd widths."""
    moe = _dense_block(n_shared, inter)
    x = torch.randn(t, D).bfloat16()
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "torch")
    monkeypatch.setenv("LOWBIT_ROUTE_LINEAR", "torch")
    want = moe(x)
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "triton_moe_dense_shared")
    monkeypatch.delenv("LOWBIT_ROUTE_LINEAR")
    routes.reset_counters()
    got = moe(x)
    calls = routes.counters()["route_calls"]
    assert [c["route"] for c in calls if c["op"] == "moe"] == ["triton_moe_dense_shared"]
    assert not [c for c in calls if c["op"] in ("linear", "act")], calls  # no separate shared MLP
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 2e-2
    # the shared slots are the shared MLP: zero it and the result moves by its output
    shared_out = moe.shared_experts(x)
    assert rel_err(shared_out, torch.zeros_like(shared_out)) > 0.5
    moe.shared_experts.gate_up_proj.weight.data.zero_()
    assert rel_err(moe(x), want - shared_out) < 3e-2


def test_dense_shared_route_admission(monkeypatch):
    """The route is OPT_IN (no GPU record yet). It refuses a block whose shared MLP is not
    merged (not prepared for serving) and a step the decode route gives to its tiles; then
    triton_fused_moe_decode runs the routed gemv and the shared MLP on its own, with the
    same result."""
    moe = _dense_block(2, 40)
    x = torch.randn(2, D).bfloat16()
    route = routes.ops()["moe"].get("triton_moe_dense_shared")
    assert route.status == routes.OPT_IN
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "triton_moe_dense_shared")
    fused = moe(x)
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "triton_fused_moe_decode")
    routes.reset_counters()
    unfused = moe(x)
    assert [c for c in routes.counters()["route_calls"] if c["op"] == "linear"]
    assert rel_err(unfused, fused) < 2e-2
    moe.shared_experts.gate_up_proj = None
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "triton_moe_dense_shared")
    with pytest.raises(LowbitError, match="not prepared for serving"):
        moe(x)
    moe = _dense_block(2, 40)
    with pytest.raises(LowbitError, match="tiles, not its per-slot gemv"):
        moe(torch.randn(8, D).bfloat16())  # 8 x (top-2 + 2 shared) slots, not < 2 E = 32
