"""Hybrid MoE layouts (two formats, shared experts) against the twin, in one launch pair.

Shapes are odd on purpose (H = 48, I = 40 are not multiples of the tiles); routing is
skewed (one hot expert, several empty ones). Tolerances as in test_moe: the twin rounds
where the kernels do, so a float32 output differs only in summation order (rel 1e-3).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.kernels.moe_hybrid import fused_moe_hybrid, reference_hybrid  # noqa: E402
from lowbit.kernels.moe_layout import (  # noqa: E402
    hybrid_experts,
    make_group,
    shared_group,
    with_shared_slots,
)
from lowbit.kernels.runtime import interpreting  # noqa: E402
from tests.kernels.cases import make_weight, poisoned, rel_err  # noqa: E402

H, I = 48, 40  # noqa: E741
CFG = dict(BM=16, BN1=32, BK1=32, BN2=32, BK2=32)

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")


def _group(case: str, n: int, seed: int):
    return make_group(make_weight(case, 2 * I, H, lead=(n,), seed=seed),
                      make_weight(case, H, I, lead=(n,), seed=seed + 1))


def _skewed(t: int, a: int, e: int, hot: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:a] for _ in range(t)])
    ids[:, 0] = hot  # every token picks the hot expert first
    ids[ids == 1] = hot + 1 if a > 1 else 0  # expert 1 stays empty
    ids = torch.stack([torch.unique(r, sorted=False) if r.unique().numel() == a else r for r in ids])
    return ids.to(torch.int32), torch.rand(t, a, generator=g)


@pytest.mark.parametrize("mode", ["decode", "grouped"])
@pytest.mark.parametrize("cases", [("nvfp4_two_tables", "nf3"), ("int4_g32_offsets", "lut3_offsets")])
def test_two_formats_one_launch(mode, cases):
    hot_ids, cold_ids = [5, 2], [0, 1, 3, 4, 6]  # layer experts held by each group
    experts = hybrid_experts([_group(cases[0], 2, 1), _group(cases[1], 5, 3)], [hot_ids, cold_ids])
    for t, a in ((1, 2), (5, 3), (17, 2)) if mode == "grouped" else ((1, 2), (5, 3)):
        ids, wts = _skewed(t, a, 7, hot=5, seed=t)
        x = torch.randn(t, H).bfloat16()
        out = poisoned(t, H, dtype=torch.float32)
        fused_moe_hybrid(x, ids, wts, experts, mode=mode, config=CFG, out=out)
        ref = reference_hybrid(x.float(), ids, wts, experts, dot_dtype=torch.bfloat16)
        assert rel_err(out, ref) < 1e-3, (cases, mode, t)


def test_hybrid_group_matches_plain_route():
    """One group holding every expert gives the plain fused route's answer (same decode)."""
    from lowbit.kernels.moe import fused_moe

    w13, w2 = make_weight("nf3", 2 * I, H, lead=(4,), seed=7), make_weight("nf3", H, I, lead=(4,), seed=8)
    experts = hybrid_experts([make_group(w13, w2)], [[0, 1, 2, 3]])
    ids, wts = _skewed(3, 2, 4, hot=2, seed=3)
    x = torch.randn(3, H).bfloat16()
    y1 = fused_moe_hybrid(x, ids, wts, experts, config=CFG, out=poisoned(3, H, dtype=torch.float32))
    y2 = fused_moe(x, ids, wts, w13, w2, config=CFG, out=poisoned(3, H, dtype=torch.float32))
    assert rel_err(y1, y2) < 1e-6


@pytest.mark.parametrize("n_shared", [1, 2])
def test_shared_experts_fused_as_slots(n_shared):
    """Routed stack (group 0, no copy) + shared MLP split into n_shared experts (group 1)
    equals routed experts plus the shared gated MLP computed densely."""
    from lowbit.kernels.moe import reference_moe

    e, case, i = 5, "nvfp4_two_tables", 32  # a shared width split in experts: I % B == 0
    w13, w2 = make_weight(case, 2 * i, H, lead=(e,), seed=1), make_weight(case, H, i, lead=(e,), seed=2)
    gate = make_weight(case, n_shared * i, H, seed=3)
    up = make_weight(case, n_shared * i, H, seed=4)
    down = make_weight(case, H, n_shared * i, seed=5)
    experts = hybrid_experts([make_group(w13, w2), shared_group(gate, up, down, n_shared)],
                             [list(range(e)), list(range(e, e + n_shared))])
    t = 4
    ids, wts = _skewed(t, 2, e, hot=3, seed=9)
    x = torch.randn(t, H)
    ids2, wts2 = with_shared_slots(ids, wts, e, n_shared)
    out = poisoned(t, H, dtype=torch.float32)
    fused_moe_hybrid(x, ids2, wts2, experts, config=CFG, out=out)
    dg, du, dd = gate.dense(H), up.dense(H), down.dense(n_shared * i)
    shared = (torch.nn.functional.silu(x @ dg.t()) * (x @ du.t())) @ dd.t()
    ref = reference_moe(x, ids, wts, w13, w2) + shared
    assert rel_err(out, ref) < 3e-2  # bf16 operands (x, w, h) against an unrounded float32 sum
    assert rel_err(out, reference_hybrid(x, ids2, wts2, experts, dot_dtype=torch.bfloat16)) < 1e-3


def test_empty_and_single_token():
    experts = hybrid_experts([_group("nvfp4_two_tables", 1, 1), _group("nf3", 3, 3)], [[3], [0, 1, 2]])
    ids = torch.tensor([[3]], dtype=torch.int32)  # one token, only the hot expert
    x = torch.randn(1, H).bfloat16()
    out = poisoned(1, H, dtype=torch.float32)
    fused_moe_hybrid(x, ids, torch.ones(1, 1), experts, config=CFG, out=out)
    assert rel_err(out, reference_hybrid(x.float(), ids, torch.ones(1, 1), experts,
                                         dot_dtype=torch.bfloat16)) < 1e-3


def test_layout_errors():
    from lowbit.errors import LowbitError

    with pytest.raises(LowbitError):
        hybrid_experts([_group("nf3", 2, 1)], [[0, 2]])  # expert 1 in no group
    with pytest.raises(LowbitError):
        make_group(torch.randn(2, 2 * I, H), torch.randn(2, H, I))  # dense: not a LUT group
