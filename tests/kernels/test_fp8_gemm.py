"""FP8 W8A8 against its twin (same per-token quantization of x, float32 product)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.kernels.fp8_gemm import fp8_w8a8, reference_w8a8, w8a8_refusal  # noqa: E402
from lowbit.kernels.runtime import interpreting  # noqa: E402
from lowbit.kernels.samples import random_fp8_view  # noqa: E402
from tests.kernels.cases import poisoned, rel_err  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")


@pytest.mark.parametrize("layout", ["channel", "block"])
def test_w8a8_matches_twin(layout):
    w = random_fp8_view(150, 300, layout=layout, seed=5)
    bias = torch.randn(150)
    for m in (1, 17):
        x = torch.randn(m, 300)  # float32 output: the product itself is exact here
        out = poisoned(m, 150, dtype=torch.float32)
        fp8_w8a8(x, w, bias, config=dict(BM=16, BN=64, BK=128), out=out)
        assert rel_err(out, reference_w8a8(x, w, bias)) < 1e-5


def test_w8a8_refuses_e8m0_scales():
    w = random_fp8_view(32, 64, layout="mx")
    assert "float32 weight scales" in w8a8_refusal(torch.randn(1, 64), w)
