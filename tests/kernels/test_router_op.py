"""The `router` op: the Triton top-k route against the torch reference over odd shapes, the
grouped (DeepSeek) case, admission reasons and forcing.

Logits are random normal, so scores are distinct and ids must match exactly, in order;
weights agree to 1e-6 (float32 softmax / sigmoid and sums in another order).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.errors import LowbitError  # noqa: E402
from lowbit.kernels import router_op, routes  # noqa: E402
from lowbit.kernels.router_op import RouterSpec, gate_logits, reference_route, route_topk  # noqa: E402
from lowbit.kernels.runtime import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv("LOWBIT_ROUTE_ROUTER", "triton_topk")
    routes.reset_counters()
    yield
    ran = {c["route"] for c in routes.counters()["route_calls"] if c["op"] == "router"}
    assert ran == {"triton_topk"}


def _case(T: int, E: int, seed: int, biased: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(E, generator=g) * 0.2 if biased else None
    return torch.randn(T, E, generator=g) * 2, bias


def _check(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None) -> None:
    ids, w = route_topk(logits, spec, bias)
    want_ids, want_w = reference_route(logits, spec, bias)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids.shape == w.shape == (logits.shape[0], spec.top_k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("E", [8, 60, 128])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_triton_topk_matches_reference(forced, T, E, top_k, scoring):
    for i, (norm, scaling, biased) in enumerate([(True, 1.0, False), (False, 2.5, scoring == "sigmoid")]):
        logits, bias = _case(T, E, seed=T * 1000 + E * 10 + top_k + i, biased=biased)
        _check(logits, RouterSpec(top_k, scoring, norm_topk=norm, scaling=scaling), bias)


@pytest.mark.parametrize("group_score", ["top2sum", "max"])
@pytest.mark.parametrize("groups", [(8, 4, 8), (4, 1, 2), (3, 2, 6)])  # n_group, topk_group, top_k
def test_triton_topk_grouped_matches_reference(forced, group_score, groups):
    n_group, topk_group, top_k = groups
    E = 8 * n_group if n_group != 3 else 60
    logits, bias = _case(5, E, seed=n_group, biased=True)
    spec = RouterSpec(top_k, "sigmoid", True, n_group, topk_group, group_score, 2.5)
    _check(logits, spec, bias)
    ids, _ = route_topk(logits, spec, bias)
    assert all(len(set(row)) <= topk_group for row in (ids // (E // n_group)).tolist())


def test_ties_go_to_the_lowest_index(forced):
    logits = torch.zeros(2, 16)
    logits[1, [3, 9, 12]] = 1.0
    ids, w = route_topk(logits, RouterSpec(4))
    assert ids.tolist() == [[0, 1, 2, 3], [3, 9, 12, 0]]
    torch.testing.assert_close(w.sum(-1), torch.ones(2))


@pytest.mark.parametrize("spec", [RouterSpec(8), RouterSpec(8, "sigmoid", True, 8, 4, "top2sum", 2.5)])
def test_nan_rows_name_experts_in_range(forced, spec):
    """A NaN logits row (a broken model, stale graph padding) must not name expert E: the
    MoE's expert sort would index past the stack. The finite rows are untouched."""
    logits, bias = _case(4, 64, seed=5, biased=spec.scoring == "sigmoid")
    logits[0] = float("nan")
    logits[2, 17] = float("nan")
    ids, w = route_topk(logits, spec, bias)
    assert ids.min().item() >= 0 and ids.max().item() < 64
    want_ids, want_w = reference_route(logits[[1, 3]], spec, bias)
    assert torch.equal(ids[[1, 3]], want_ids)
    torch.testing.assert_close(w[[1, 3]], want_w, rtol=0, atol=1e-6)


def test_strided_logits_and_no_tokens(forced):
    wide, _ = _case(4, 96, seed=1, biased=False)
    _check(wide[:, :64], RouterSpec(4), None)  # row stride 96
    ids, w = route_topk(torch.zeros(0, 64), RouterSpec(2))
    assert ids.shape == w.shape == (0, 2)


def test_admission_reasons():
    triton_topk = routes.ops()["router"].get("triton_topk")

    def reason(logits, spec=None, bias=None, forced=True):
        return triton_topk.admit(router_op.RouterCall(logits, spec or RouterSpec(2), bias, forced))

    x = torch.randn(3, 64)
    assert reason(x) is None
    assert "TRITON_INTERPRET=1 and a forced route" in reason(x, forced=False)
    assert "float32" in reason(x.bfloat16())
    assert "> 1024" in reason(torch.randn(1, 1025))
    assert "top_k 17" in reason(x, RouterSpec(17))
    assert "top_k 9 is outside 1..8" in reason(torch.randn(1, 8), RouterSpec(9))
    assert "score bias" in reason(x, bias=torch.zeros(63))
    assert "do not split into 5 groups" in reason(x, RouterSpec(2, n_group=5, topk_group=1))
    assert "from 1 of 8 groups of 8" in reason(x, RouterSpec(9, n_group=8, topk_group=1))
    assert "groups of 1" in reason(x, RouterSpec(2, n_group=64, topk_group=4))
    assert reason(x, RouterSpec(2, n_group=64, topk_group=4, group_score="max")) is None


def test_forcing_a_refusing_route_fails_closed(monkeypatch):
    monkeypatch.setenv("LOWBIT_ROUTE_ROUTER", "triton_topk")
    with pytest.raises(LowbitError, match="float32"):
        route_topk(torch.randn(2, 8).bfloat16(), RouterSpec(2))


def test_cpu_auto_selection_runs_the_reference_and_counts_the_refusal(monkeypatch):
    monkeypatch.delenv("LOWBIT_ROUTE_ROUTER", raising=False)
    routes.reset_counters()
    logits, bias = _case(3, 16, seed=5, biased=True)
    ids, w = route_topk(logits, RouterSpec(2, "sigmoid"), bias, layer="model.layers.0.mlp")
    want_ids, want_w = reference_route(logits, RouterSpec(2, "sigmoid"), bias)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
    c = routes.counters()
    assert {"op": "router", "layer": "model.layers.0.mlp", "route": "torch", "count": 1} in c["route_calls"]
    assert any(r["op"] == "router" and r["route"] == "triton_topk" for r in c["route_refusals"])


def _old_route(logits, spec, bias=None):
    """layers/moe.py's router before the op existed, kept verbatim as the fixed point."""
    scores = torch.sigmoid(logits.float()) if spec.scoring == "sigmoid" else torch.softmax(logits.float(), -1)
    choice = scores if bias is None else scores + bias.float()
    if spec.n_group > 1:
        T, E = choice.shape
        grouped = choice.view(T, spec.n_group, E // spec.n_group)
        if spec.group_score == "top2sum":
            gscore = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            gscore = grouped.max(dim=-1).values
        keep = torch.zeros_like(gscore).scatter_(1, gscore.topk(spec.topk_group, dim=-1).indices, 1.0)
        mask = keep[:, :, None].expand_as(grouped).reshape(T, E)
        choice = choice.masked_fill(mask == 0, float("-inf"))
    ids = choice.topk(spec.top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if spec.norm_topk:
        w = w / (w.sum(-1, keepdim=True) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
    return ids.to(torch.int32), w * spec.scaling


@pytest.mark.parametrize("spec", [RouterSpec(2), RouterSpec(8, "sigmoid", True, 8, 4, "top2sum", 2.5),
                                  RouterSpec(6, "softmax", False, 8, 3, "max", 16.0)])
def test_torch_route_is_the_old_router_bit_for_bit(spec):
    logits, bias = _case(9, 64, seed=7, biased=spec.scoring == "sigmoid")
    ids, w = router_op._run_torch(router_op.RouterCall(logits.bfloat16(), spec, bias))
    want_ids, want_w = _old_route(logits.bfloat16(), spec, bias)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)


def test_gate_logits_is_the_float32_gemm():
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(5, 32, generator=g).bfloat16(), torch.randn(16, 32, generator=g), torch.randn(16, generator=g)
    out = gate_logits(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (5, 16)
    assert torch.equal(out, torch.nn.functional.linear(x.float(), w, b))
    assert torch.equal(gate_logits(x, w), torch.nn.functional.linear(x.float(), w))


@pytest.mark.parametrize("T,E,D,xdtype", [(1, 8, 200, torch.float32), (5, 60, 96, torch.bfloat16),
                                          (2, 128, 64, torch.float32)])
def test_fused_gate_topk_matches_reference(monkeypatch, T, E, D, xdtype):
    """One launch for the gate GEMV and the top-k: ids equal the reference's (random logits
    are far from ties) and weights agree to 1e-5 (float32 sums in another order)."""
    monkeypatch.setenv("LOWBIT_ROUTE_ROUTER", "triton_gate_topk")
    g = torch.Generator().manual_seed(T * 100 + E + D)
    x = torch.randn(T, D, generator=g).to(xdtype)
    gw, gb = torch.randn(E, D, generator=g) * 0.3, torch.randn(E, generator=g)
    for spec, bias in ((RouterSpec(min(8, E // 2)), None),
                       (RouterSpec(2, "sigmoid", True, 4, 2, "top2sum", 2.5), torch.randn(E, generator=g) * 0.1)):
        if spec.n_group > 1 and E % 4:
            continue
        for _ in range(2):  # a counter left non-zero would skip the second call's ranking
            ids, w = router_op.route(x, gw, gb, spec, bias)
            want_ids, want_w = reference_route(gate_logits(x, gw, gb), spec, bias)
            assert torch.equal(ids, want_ids), (spec, ids, want_ids)
            torch.testing.assert_close(w, want_w, rtol=0, atol=1e-5)


def test_fused_gate_topk_admission():
    fused = routes.ops()["router"].get("triton_gate_topk")
    gw = torch.randn(16, 32)

    def reason(x, w=gw, logits=None, forced=True):
        call = router_op.RouterCall(logits, RouterSpec(2), None, forced, x=x, gate_w=w)
        return fused.admit(call)

    x = torch.randn(3, 32)
    assert reason(x) is None
    assert "TRITON_INTERPRET=1 and a forced route" in reason(x, forced=False)
    assert "17 tokens > 16" in reason(torch.randn(17, 32))
    assert "contiguous float32" in reason(x, gw.bfloat16())
    assert "contiguous float32" in reason(x, gw.t().contiguous().t())
    assert "made by the caller" in reason(None, logits=torch.randn(3, 16))


@pytest.mark.parametrize("T,E,D,xdtype", [(1, 128, 2048, torch.bfloat16), (5, 60, 200, torch.float32),
                                          (17, 30, 96, torch.float16), (64, 8, 72, torch.bfloat16)])
def test_triton_gate_logits_matches_the_float32_gemm(T, E, D, xdtype):
    """_gate_gemv_kernel: fresh random x / weight / bias over odd shapes (T not a multiple of
    the 4-token tile, E odd multiples of the 2-expert block, D not a power of two); the
    output starts as NaN so that an unwritten logit fails."""
    g = torch.Generator().manual_seed(T * 7 + E + D)
    x = torch.randn(T, D, generator=g).to(xdtype)
    gw, gb = torch.randn(E, D, generator=g) * 0.1, torch.randn(E, generator=g)
    for bias in (gb, None):
        got = router_op.triton_gate_logits(x, gw, bias)
        want = gate_logits(x, gw, bias)
        assert got.dtype == torch.float32 and got.shape == (T, E)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    cfg = router_op.gemv_config(T, E, D)
    out = torch.full((T, E), float("nan"))
    router_op._gate_gemv_kernel[(-(-T // cfg["BT"]), -(-E // cfg["BE"]))](
        x, gw, gb, out, T, D, E, x.stride(0), BT=cfg["BT"], BE=cfg["BE"], BD=cfg["BD"], HAS_GB=True,
        PDL=False)
    assert not out.isnan().any()
    torch.testing.assert_close(out, gate_logits(x, gw, gb), rtol=1e-5, atol=1e-4)


def test_gate_gemv_admission_by_size():
    def refused(T, E, D):
        call = router_op.RouterCall(None, RouterSpec(4), None, x=torch.randn(T, D).bfloat16(),
                                    gate_w=torch.randn(E, D))
        return router_op._gemv_refusal(call)

    assert refused(64, 128, 2048) is None  # Qwen3-30B-A3B: 2**24
    assert refused(16, 256, 7168) is None  # DeepSeek-V3 up to 16 tokens
    assert "cuBLAS" in refused(64, 256, 7168)
    assert "cuBLAS" in refused(65, 8, 16)


@pytest.mark.parametrize("T", [1, 6, 65])
def test_triton_topk_route_from_x(forced, T):
    """route(x, ...) on the triton_topk route: the logits come from the Triton gate GEMV up
    to 64 tokens and from the float32 GEMM above; the ids and weights match the reference."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 48, generator=g).bfloat16()
    gw = torch.randn(32, 48, generator=g) * 0.3
    assert (router_op._gemv_refusal(router_op.RouterCall(None, RouterSpec(4), None, x=x, gate_w=gw))
            is None) == (T <= router_op.GEMV_MAX_TOKENS)
    ids, w = router_op.route(x, gw, None, RouterSpec(4))
    want_ids, want_w = reference_route(gate_logits(x, gw), RouterSpec(4))
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=0, atol=1e-5)


def test_fused_config_one_warp_unless_the_row_is_wide():
    assert router_op.fused_config(128, 2048, RouterSpec(8))["num_warps"] == 1
    assert router_op.fused_config(256, 7168, RouterSpec(8, "sigmoid", True, 8, 4))["num_warps"] == 1
    assert router_op.fused_config(1024, 4096, RouterSpec(8))["num_warps"] == 4
    assert router_op.fused_config(128, 2048, RouterSpec(8))["BD"] == 1024
