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


def test_scaled_mm_route_matches_twin(monkeypatch):
    """The forced torch_scaled_mm route (W8A8 through torch._scaled_mm, also on the CPU) gives
    reference_w8a8's product, rounded once to bf16; odd M pads the rows to 16."""
    from lowbit.kernels import linear
    from lowbit.kernels.weights import resolve

    monkeypatch.setenv("LOWBIT_ROUTE_LINEAR", "torch_scaled_mm")
    w = resolve(random_fp8_view(96, 320, layout="channel", seed=3))
    bias = torch.randn(96)
    for m in (1, 5, 17):
        x = torch.randn(m, 320).bfloat16()
        y = linear(x, w, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 96)
        assert rel_err(y, reference_w8a8(x, w, bias)) < 1e-2, m


@pytest.mark.parametrize("m", [1, 7, 16, 21])
def test_scaled_mm_modes_round_once_to_the_twin(m):
    """Tensor-wise mode (float32 product + the scale epilogue) and row-wise mode give the
    twin's product; the epilogue rounds once, so it is the twin's float32 result rounded to
    bf16 up to float32 summation order."""
    from lowbit.kernels.fp8_gemm import scaled_mm_w8a8
    from lowbit.kernels.weights import resolve

    w = resolve(random_fp8_view(48, 160, layout="channel", seed=m))
    x, bias = torch.randn(m, 160).bfloat16(), torch.randn(48)
    want = reference_w8a8(x, w, bias)
    tw = scaled_mm_w8a8(x, w, bias)
    assert tw.shape == (m, 48) and torch.isfinite(tw).all()
    assert rel_err(tw, want) < 5e-3
    assert rel_err(scaled_mm_w8a8(x, w, bias, mode="rowwise"), want) < 1e-2


def test_scaled_mm_refusals():
    from lowbit.kernels.fp8_gemm import scaled_mm_refusal
    from lowbit.kernels.weights import resolve

    x = torch.randn(2, 256).bfloat16()
    assert "128x128" in scaled_mm_refusal(x, resolve(random_fp8_view(256, 256, layout="block")))
    assert "writes bf16" in scaled_mm_refusal(x.half(), resolve(random_fp8_view(64, 256, layout="channel")))
    assert "multiples of 16" in scaled_mm_refusal(x, resolve(random_fp8_view(40, 256, layout="channel")))
    assert scaled_mm_refusal(x, resolve(random_fp8_view(64, 256, layout="channel"))) is None
