"""The expert copy kernel (lowbit/kernels/expert_copy.py) against plain indexing: every
valid pair's rows land in its slot, nothing else is written, odd row sizes included."""

import pytest
import torch

from lowbit.kernels import expert_copy
from lowbit.kernels.runtime import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="runs the Triton kernel in the interpreter")


@pytest.mark.parametrize("shapes", [
    {"codes": ((6, 40), torch.uint8), "scales": ((6, 5), torch.bfloat16)},  # bytes, 10-byte rows
    {"w": ((5, 3, 7), torch.float32)},  # words, 21 a row
    {"codes": ((4, 4100), torch.int32)},  # two programs a row (BLOCK 4096 words)
    # eight word tensors of different row lengths and a byte tensor: two launches of the
    # pieces kernel (6 + 3), words and bytes in the same launch
    {**{f"t{i}": ((5, 3 + 5 * i), torch.int32) for i in range(7)}, "long": ((5, 4097), torch.float32),
     "odd": ((5, 7), torch.uint8)},
])
def test_copies_exactly_the_valid_pairs(shapes):
    torch.manual_seed(0)
    src = {k: (torch.randn(s) * 100).to(dt) for k, (s, dt) in shapes.items()}
    # six rows poisoned with NaN (0xFF bytes for integer tensors); the copies may name 0..4,
    # so a write past row 4 shows in row 5
    full = {k: torch.full((6, *s[1:]), float("nan")).to(dt) for k, (s, dt) in shapes.items()}
    for t in full.values():
        if not t.is_floating_point():
            t.view(torch.uint8).fill_(0xFF)
    dst = {k: t[:5] for k, t in full.items()}
    before = {k: t.clone() for k, t in full.items()}
    pairs = torch.tensor([[2, 4], [-1, -1], [0, 1], [3, 0], [-1, 2]], dtype=torch.int64)
    expert_copy.copy_experts(pairs, src, dst, kernel=True)
    for k, t in full.items():
        assert torch.equal(t[5].view(torch.uint8), before[k][5].view(torch.uint8)), k
    for k, d in dst.items():
        for e, s in ((2, 4), (0, 1), (3, 0)):
            assert torch.equal(d[s].view(torch.uint8), src[k][e].contiguous().view(torch.uint8)), (k, e, s)
        for s in (2, 3):  # no valid pair names these slots: untouched (NaN stays NaN)
            assert torch.equal(d[s].view(torch.uint8), before[k][s].view(torch.uint8)), (k, s)


def test_the_cpu_path_copies_the_same():
    src = {"w": torch.arange(24, dtype=torch.float32).view(4, 6)}
    dst = {"w": torch.zeros(3, 6)}
    expert_copy.copy_experts(torch.tensor([[3, 0], [1, 2], [-1, -1]]), src, dst)
    assert dst["w"].tolist() == [src["w"][3].tolist(), [0.0] * 6, src["w"][1].tolist()]
