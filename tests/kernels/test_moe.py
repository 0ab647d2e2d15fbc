"""Fused MoE (decode and grouped mappings) against the expert-loop twin.

Routing is skewed on purpose: some experts get no token, one gets most of them.
The twin rounds x, the decoded weights and h where the kernels do (dot_dtype, rounding as the
backend does: lowbit.kernels.runtime.round_for_dot), so with a float32 output only summation
order differs (rel 1e-3: a few h values may round the other way); a bf16 output: rel 1e-2.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.kernels.moe import fused_moe, fused_moe_gemv, reference_moe  # noqa: E402
from lowbit.kernels.runtime import interpreting  # noqa: E402
from lowbit.kernels.weights import resolve  # noqa: E402
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
                                  "lut3_offsets", "fp8_block"])
def test_fused_moe_gemv_matches_twin(case):
    """Per-slot GEMV decode: float32 throughout, so the twin needs no rounding (rel 1e-5)."""
    w13 = make_weight(case, 2 * I, H, lead=(E,), seed=1)
    w2 = make_weight(case, H, I, lead=(E,), seed=2)
    cfg = dict(BN=16, G=8, SPLIT_K=2)
    for t, a in ((1, 2), (5, 3)):
        ids, wts = _routing(t, a, seed=t + 10)
        x = torch.randn(t, H)
        out = poisoned(t, H, dtype=torch.float32)
        fused_moe_gemv(x, ids, wts, w13, w2, config=cfg, out=out)
        assert rel_err(out, reference_moe(x, ids, wts, w13, w2)) < 1e-5, (case, t)


def test_grouped_sort_has_no_host_read():
    """The grouped route's expert sort runs only device ops (CUDA-graph safe): no bincount,
    nonzero, unique or scalar read; and it agrees with a host-side count."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lowbit.kernels.moe import sort_by_expert

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
