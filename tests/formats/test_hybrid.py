"""HybridTensor: an expert stack held by parts in two formats."""

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.formats import get_format
from lowbit.formats.hybrid import HybridTensor

E, N, K = 4, 8, 64
HOT, COLD = [2], [0, 1, 3]


def _stack(seed=0):
    w = torch.randn(E, N, K, generator=torch.Generator().manual_seed(seed))
    parts = {"hot": get_format("nvfp4").quantize(w[HOT]), "cold": get_format("nf3").quantize(w[COLD])}
    return HybridTensor((E, N, K), parts, {"hot": HOT, "cold": COLD})


def test_experts_read_through_their_part():
    h = _stack()
    assert len(h) == E and h.format.name == "hybrid(hot=nvfp4,cold=nf3)"
    dense = h.dequantize()
    assert dense.shape == (E, N, K)
    torch.testing.assert_close(dense[2], h.parts["hot"][0].dequantize(), rtol=0, atol=0)
    torch.testing.assert_close(dense[3], h.parts["cold"][2].dequantize(), rtol=0, atol=0)
    assert h.nbytes == h.parts["hot"].nbytes + h.parts["cold"].nbytes
    with pytest.raises(LowbitError, match="out of range"):
        h[E]


def test_every_expert_sits_in_exactly_one_part():
    h = _stack()
    with pytest.raises(LowbitError, match="exactly one part"):
        HybridTensor((E, N, K), h.parts, {"hot": [2, 0], "cold": COLD})
    with pytest.raises(LowbitError, match="expected 2 experts"):
        HybridTensor((E + 1, N, K), h.parts, {"hot": [2, 4], "cold": COLD})
