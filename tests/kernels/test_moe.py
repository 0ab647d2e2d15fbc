"""Fused MoE (decode and grouped mappings) against the expert-loop twin.

Routing is skewed on purpose: some experts get no token, one gets most of them.
gpt-oss experts (biases b13 / b2 and the clamped SwiGLU) are checked on every path with a
limit set from the data, so that a good share of the pre-activations pass it.
The twin rounds x, the decoded weights and h where the kernels do (dot_dtype, rounding as the
backend does: lowbit.kernels.runtime.round_for_dot), so with a float32 output only summation
order differs (rel 1e-3: a few h values may round the other way); a bf16 output: rel 1e-2.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.kernels import routes  # noqa: E402
from lowbit.kernels.moe import fused_moe, fused_moe_gemv, reference_moe  # noqa: E402
from lowbit.kernels.moe_op import MoeActivation, moe_experts  # noqa: E402
from lowbit.kernels.runtime import interpreting  # noqa: E402
from lowbit.kernels.weights import expert_dense, resolve  # noqa: E402
from tests.kernels.cases import make_weight, poisoned, rel_err  # noqa: E402

E, H, I = 6, 48, 40  # noqa: E741
BF16_RTOL = 1e-2
CFG = dict(BM=16, BN1=32, BK1=32, BN2=32, BK2=32)

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")


def _routing(t: int, a: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    favourites = torch.tensor([3, 0, 5])  # experts 1, 2, 4 stay empty
    ids = torch.stack([favourites[torch.randperm(3, generator=g)[:a]] for _ in range(t)])
    ids[: t // 2 + 1, 0] = 3  # skew: most tokens pick expert 3 first
    ids[: t // 2 + 1, 1:] = torch.tensor([0, 5])[: a - 1]
    return ids.to(torch.int32), torch.rand(t, a, generator=g)


@pytest.mark.parametrize("case", ["int4_g32_offsets", "nvfp4_two_tables", "mxfp4", "nf3",
                                  "lut3_offsets", "fp8_block", "dense"])
@pytest.mark.parametrize("mode", ["decode", "grouped"])
def test_fused_moe_matches_twin(case, mode):
    if case == "dense":
        g = torch.Generator().manual_seed(1)
        w13 = resolve((torch.randn(E, 2 * I, H, generator=g) * 0.2).bfloat16())
        w2 = resolve((torch.randn(E, H, I, generator=g) * 0.2).bfloat16())
    else:
        w13 = make_weight(case, 2 * I, H, lead=(E,), seed=1)
        w2 = make_weight(case, H, I, lead=(E,), seed=2)
    for t, a in ((1, 2), (3, 2), (17, 3)) if mode == "grouped" else ((1, 2), (5, 3)):
        ids, wts = _routing(t, a, seed=t)
        x = torch.randn(t, H).bfloat16()
        out = poisoned(t, H, dtype=torch.float32 if t > 1 else torch.bfloat16)
        fused_moe(x, ids, wts, w13, w2, mode=mode, config=CFG, out=out)
        ref = reference_moe(x if t == 1 else x.float(), ids, wts, w13, w2, dot_dtype=torch.bfloat16)
        assert rel_err(out, ref) < (1e-3 if t > 1 else BF16_RTOL), (case, mode, t)


def test_grouped_tiles_span_one_expert():
    """BM = 16 with 17 tokens on one expert: the expert's slots need two tiles."""
    w13 = make_weight("nf4", 2 * I, H, lead=(E,), seed=4)
    w2 = make_weight("nf4", H, I, lead=(E,), seed=5)
    ids = torch.full((17, 1), 2, dtype=torch.int32)
    wts = torch.rand(17, 1)
    x = torch.randn(17, H).bfloat16()
    out = poisoned(17, H, dtype=torch.bfloat16)
    fused_moe(x, ids, wts, w13, w2, mode="grouped", config=CFG, out=out)
    assert rel_err(out, reference_moe(x, ids, wts, w13, w2, dot_dtype=torch.bfloat16)) < BF16_RTOL


@pytest.mark.parametrize("case", ["int4_g32_offsets", "nvfp4_two_tables", "mxfp4", "nf3",
                                  "lut3_offsets", "fp8_block", "dense"])
def test_fused_moe_gemv_matches_twin(case):
    """Per-slot GEMV decode: float32 throughout, so the twin needs no rounding (rel 1e-5);
    dense bf16 experts are read as words of two weights."""
    w13, w2 = _oss_weights(case)
    # SORT_SLOTS (programs launched in expert order, same sums) where there is an order to sort
    for sort, t, a in ((False, 1, 2), (True, 5, 3)):
        cfg = dict(BN=16, G=8, SPLIT_K=2, SORT_SLOTS=sort)
        ids, wts = _routing(t, a, seed=t + 10)
        x = torch.randn(t, H)
        out = poisoned(t, H, dtype=torch.float32)
        fused_moe_gemv(x, ids, wts, w13, w2, config=cfg, out=out)
        assert rel_err(out, reference_moe(x, ids, wts, w13, w2)) < 1e-5, (case, t, sort)


def test_grouped_sort_has_no_host_read():
    """The grouped route's expert sort runs only device ops (CUDA-graph safe): no bincount,
    nonzero, unique or scalar read; and it agrees with a host-side count."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lowbit.kernels.moe_slots import sort_by_expert

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    ids, _ = _routing(17, 3, seed=4)
    flat = ids.reshape(-1).contiguous()
    with Record() as rec:
        order, tile_end, seg_start, counts, tiles = sort_by_expert(flat, E, 16)
    host = ("bincount", "nonzero", "unique", "_local_scalar_dense", "item")
    assert not [op for op in rec.ops if any(h in op for h in host)], rec.ops
    want = torch.bincount(flat.long(), minlength=E)
    assert torch.equal(counts.long(), want)
    assert torch.equal(tile_end.long(), torch.cumsum((want + 15) // 16, 0))
    assert torch.equal(seg_start.long(), torch.cumsum(want, 0) - want)
    assert torch.equal(flat[order.long()], torch.sort(flat).values) and tiles == 4 + 6


@pytest.mark.parametrize("mode", ["pair", "one_launch", "one_program"])
@pytest.mark.parametrize("s,e,bm", [(1, 8, 16), (51, 60, 16), (4096, 128, 64), (1000, 256, 32),
                                    (5, 512, 16), (300, 7, 64)])
def test_counting_sort_is_torch_stable_sort(s, e, bm, mode, monkeypatch):
    """The counting sort (two launches; one launch whose programs count every block; one
    program: each forced here) against torch.sort(stable=True) and bincount on fresh random
    ids, odd slot and expert counts, several blocks; then with ids outside 0..E-1 (a NaN
    routing row): those slots are counted and placed nowhere, the rest still sort."""
    from lowbit.kernels import moe_slots
    from lowbit.kernels.moe_slots import sort_by_expert

    monkeypatch.setattr(moe_slots, "ONE_PROGRAM_SORT_BLOCKS", 1 << 20 if mode == "one_program" else 0)
    monkeypatch.setattr(moe_slots, "ONE_LAUNCH_SORT_BLOCKS", 1 << 20 if mode == "one_launch" else 0)

    g = torch.Generator().manual_seed(s * 7 + e)
    ids = torch.randint(0, e, (s,), generator=g).to(torch.int32)
    for bad in (False, True):
        if bad:
            ids[::3] = e  # the router's old argmax sentinel
            ids[1::7] = -1
        order, tile_end, seg_start, counts, tiles = sort_by_expert(ids, e, bm)
        ok = (ids >= 0) & (ids < e)
        want = torch.bincount(ids[ok].long(), minlength=e)
        assert torch.equal(counts.long(), want)
        assert torch.equal(seg_start.long(), torch.cumsum(want, 0) - want)
        assert torch.equal(tile_end.long(), torch.cumsum((want + bm - 1) // bm, 0))
        placed = int(ok.sum())
        stable = torch.sort(torch.where(ok, ids, e + 1), stable=True).indices[:placed]
        assert torch.equal(order[:placed].long(), stable)
        assert tiles == -(-s // bm) + min(e, s)


def test_sort_for_fold_counts_placed_slots_and_zeroes_dead_tokens():
    """sort_for_fold: the same sort as sort_by_expert in one program, need[t] = token t's
    placed slots, and out[t] = 0 for a token with none (no expert kernel writes it); other
    rows untouched. Too many slots for one program: None."""
    from lowbit.kernels.moe_slots import sort_by_expert, sort_for_fold

    t, a, e, h = 9, 4, 16, 300
    g = torch.Generator().manual_seed(5)
    ids = torch.rand(t, e, generator=g).topk(a, -1).indices.to(torch.int32)
    ids[2] = e  # a NaN routing row: no slot placed
    ids[5, 1] = -1  # one slot placed nowhere
    flat = ids.reshape(-1).contiguous()
    out = torch.full((t, h), float("nan"))
    order, tile_end, seg_start, counts, tiles, need = sort_for_fold(flat, e, 8, a, out)
    ref = sort_by_expert(flat, e, 8)
    placed = t * a - a - 1  # order past the placed slots is never written
    assert torch.equal(order[:placed], ref[0][:placed]) and tiles == ref[4]
    for got, want in zip((tile_end, seg_start, counts), ref[1:4], strict=True):
        assert torch.equal(got, want)
    want_need = torch.full((t,), a, dtype=torch.int32)
    want_need[2], want_need[5] = 0, a - 1
    assert torch.equal(need, want_need)
    assert torch.equal(out[2], torch.zeros(h)) and out[[0, 1, 3, 4, 5, 6, 7, 8]].isnan().all()
    many = torch.zeros(4096, dtype=torch.int32)
    assert sort_for_fold(many, 128, 8, 8, torch.empty(512, h)) is None


def test_combine_sums_named_slots_in_order_and_skips_the_rest():
    """combine_slots: each token's slot rows summed in slot order; a slot whose id is outside
    0..E-1 was placed nowhere, so its row (NaN here) is never read."""
    from lowbit.kernels.moe_slots import combine_slots

    t, a, h, e = 5, 3, 300, 8
    g = torch.Generator().manual_seed(3)
    ys = torch.randn(t * a, h, generator=g)
    ids = torch.randint(0, e, (t * a,), generator=g).to(torch.int32)
    ids[4], ids[9] = e, -1
    ys[4], ys[9] = float("nan"), float("nan")
    x = torch.zeros(t, h)
    y = combine_slots(ys, x, a, ids, e)
    want = torch.where(((ids >= 0) & (ids < e))[:, None], ys, 0).view(t, a, h)
    want = (want[:, 0] + want[:, 1]) + want[:, 2]
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, want, rtol=0, atol=0)


def _oss_extras(x, ids, w13, w2, seed: int) -> dict:
    """gpt-oss extras for this routing: biases b13 [E, 2I], b2 [E, H] of the pre-activations'
    and outputs' scale, and a clamp limit at the 60th percentile of |routed pre-activation|;
    asserts the clamp bites: some gate values above it, some up values outside +-limit."""
    g = torch.Generator().manual_seed(seed)
    used = torch.unique(ids).tolist()
    dense = {e: expert_dense(w13, e, H) for e in used}

    def routed_pre(b13):
        return torch.cat([x[(ids == e).any(1)].float() @ dense[e].t() + b13[e] for e in used])

    b13 = torch.randn(E, 2 * I, generator=g) * routed_pre(torch.zeros(E, 2 * I)).std()
    pre = routed_pre(b13)  # [routed slots, 2I]
    limit = pre.abs().quantile(0.6).item()
    act = MoeActivation("swiglu_oai", limit=limit)
    assert (pre[:, :I] > limit).any() and (pre[:, :I] < limit).any(), "the gate clamp bites"
    assert (pre[:, I:].abs() > limit).any(), "the up clamp bites"
    scale = reference_moe(x, ids, torch.ones(ids.shape), w13, w2, b13=b13, activation=act).float().std()
    return dict(b13=b13, b2=torch.randn(E, H, generator=g) * scale, activation=act)


def _oss_weights(case):
    if case == "dense":
        g = torch.Generator().manual_seed(1)
        return (resolve((torch.randn(E, 2 * I, H, generator=g) * 0.2).bfloat16()),
                resolve((torch.randn(E, H, I, generator=g) * 0.2).bfloat16()))
    return make_weight(case, 2 * I, H, lead=(E,), seed=1), make_weight(case, H, I, lead=(E,), seed=2)


@pytest.mark.parametrize("case", ["int4_g32_offsets", "mxfp4", "nf3", "fp8_block", "dense"])
@pytest.mark.parametrize("mode", ["decode", "grouped"])
def test_fused_moe_gpt_oss_matches_twin(case, mode):
    """Tiles with b13 / b2 and the clamped SwiGLU: tolerances as for the plain tiles."""
    w13, w2 = _oss_weights(case)
    for t, a in ((1, 2), (17, 3)) if mode == "grouped" else ((1, 2), (5, 3)):
        ids, wts = _routing(t, a, seed=t + 20)
        x = torch.randn(t, H).bfloat16()
        extras = _oss_extras(x, ids, w13, w2, seed=t)
        out = poisoned(t, H, dtype=torch.float32 if t > 1 else torch.bfloat16)
        fused_moe(x, ids, wts, w13, w2, mode=mode, config=CFG, out=out, **extras)
        ref = reference_moe(x if t == 1 else x.float(), ids, wts, w13, w2,
                            dot_dtype=torch.bfloat16, **extras)
        plain = reference_moe(x.float(), ids, wts, w13, w2, dot_dtype=torch.bfloat16)
        assert rel_err(out, ref) < (1e-3 if t > 1 else BF16_RTOL), (case, mode, t)
        assert rel_err(plain, ref) > 0.1  # the extras change the answer: a no-op would fail


@pytest.mark.parametrize("case", ["int4_g32_offsets", "nvfp4_two_tables", "mxfp4", "nf3",
                                  "fp8_block", "dense"])
def test_fused_moe_gemv_gpt_oss_matches_twin(case):
    """Per-slot GEMVs with b13 (FC1 epilogue), the clamp made on FC2's load and b2 before the
    routing weight, split-K on (the bias goes in after the ordered split sum): rel 1e-5."""
    w13, w2 = _oss_weights(case)
    for t, a, split in ((1, 2, 3), (5, 3, 1)):  # an odd split count, and none
        ids, wts = _routing(t, a, seed=t + 30)
        x = torch.randn(t, H)
        extras = _oss_extras(x, ids, w13, w2, seed=t)
        out = poisoned(t, H, dtype=torch.float32)
        fused_moe_gemv(x, ids, wts, w13, w2, config=dict(BN=16, G=8, SPLIT_K=split), out=out,
                       **extras)
        assert rel_err(out, reference_moe(x, ids, wts, w13, w2, **extras)) < 1e-5, (case, t)


def test_fused_moe_gpt_oss_bias_only_and_silu():
    """Each extra alone: biases with SiLU (gemv and tiles), and the clamp without biases."""
    w13, w2 = _oss_weights("mxfp4")
    ids, wts = _routing(5, 2, seed=40)
    x = torch.randn(5, H).bfloat16()
    extras = _oss_extras(x, ids, w13, w2, seed=5)
    for kw in (dict(b13=extras["b13"], b2=extras["b2"]), dict(b2=extras["b2"]),
               dict(activation=extras["activation"])):
        ref = reference_moe(x.float(), ids, wts, w13, w2, **kw)
        got = fused_moe_gemv(x.float(), ids, wts, w13, w2, config=dict(BN=16, G=8, SPLIT_K=1),
                             out=poisoned(5, H, dtype=torch.float32), **kw)
        assert rel_err(got, ref) < 1e-5, sorted(kw)
        ref = reference_moe(x.float(), ids, wts, w13, w2, dot_dtype=torch.bfloat16, **kw)
        got = fused_moe(x, ids, wts, w13, w2, mode="grouped", config=CFG,
                        out=poisoned(5, H, dtype=torch.float32), **kw)
        assert rel_err(got, ref) < 1e-3, sorted(kw)


@pytest.mark.parametrize("route,t", [("triton_fused_moe_decode", 2), ("triton_fused_moe_decode", 6),
                                     ("triton_moe_grouped", 9)])
def test_moe_op_routes_take_gpt_oss_experts(monkeypatch, route, t):
    """moe_experts with the extras through each forced Triton route against the torch route;
    a bias of the wrong shape or a hybrid layout with extras is a ValueError."""
    w13, w2 = _oss_weights("mxfp4")
    ids, wts = _routing(t, 2, seed=50 + t)
    x = torch.randn(t, H)
    extras = _oss_extras(x, ids, w13, w2, seed=t)
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "torch")
    ref = moe_experts(x, ids, wts, w13, w2, **extras)
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", route)
    routes.reset_counters()
    got = moe_experts(x, ids, wts, w13, w2, **extras, layer="l0")
    calls = routes.counters()["route_calls"]
    assert [c["route"] for c in calls if c["op"] == "moe"] == [route]
    # t = 2: 4 slots < 2E, per-slot gemv in float32; otherwise tiles on bf16 operands
    assert rel_err(got, ref) < (1e-5 if t == 2 else 2e-2), (route, t)
    with pytest.raises(ValueError, match="b2 is"):
        moe_experts(x, ids, wts, w13, w2, b13=extras["b13"], b2=extras["b2"][:, :-1])


def test_hybrid_layouts_refuse_gpt_oss_extras():
    from lowbit.kernels.moe_layout import HybridExperts

    layout = HybridExperts.__new__(HybridExperts)  # refused before the layout is read
    x, ids, wts = torch.randn(1, H), torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 2)
    with pytest.raises(ValueError, match="hybrid expert layouts take no expert biases"):
        moe_experts(x, ids, wts, layout, None, b2=torch.zeros(E, H))
    with pytest.raises(ValueError, match="hybrid"):
        moe_experts(x, ids, wts, layout, None, activation=MoeActivation("swiglu_oai", limit=7.0))
