"""GEMV / GEMM against the torch twin on fresh random weights of every format.

Tolerances: the gemv computes in float32 (rel 1e-5). The gemm rounds the decoded weights to
bf16 before tl.dot; the twin does the same with dot_dtype (rounding as the backend does:
lowbit.kernels.runtime.round_for_dot), so with a float32 output only the summation order
differs (rel 1e-4); a bf16 output adds its own rounding (rel 1e-2).
"""

import os
import zlib

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.kernels.dequant import dequantize, lut_dequant_mm  # noqa: E402
from lowbit.kernels.dequant_gemm import (  # noqa: E402
    gemm_split_plan,
    lut_gemm,
    lut_gemv,
    reference_linear,
)
from lowbit.kernels.runtime import interpreting, round_for_dot  # noqa: E402
from tests.kernels.cases import ALL_CASES, LUT_CASES, make_weight, poisoned, rel_err  # noqa: E402

N, K = 40, 200  # neither a power of two; K is not a multiple of any block
BF16_RTOL = 1e-2

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")


@pytest.mark.parametrize("case", ALL_CASES)
def test_gemv_matches_twin(case):
    w = make_weight(case, N, K, seed=zlib.crc32(case.encode()) % 1000)
    bias = torch.randn(N)
    for m, cfg in ((1, dict(BN=16, G=8)), (3, dict(BN=32, G=8, SPLIT_K=3)), (16, dict(BN=64, G=16))):
        x = torch.randn(m, K)
        out = poisoned(m, N, dtype=torch.float32)
        lut_gemv(x, w, bias, config=cfg, out=out)
        assert rel_err(out, reference_linear(x, w, bias)) < 1e-5, (case, m)


@pytest.mark.parametrize("case", ["int4_g32_offsets", "nvfp4_two_tables", "nf3", "fp8_block"])
def test_gemv_bf16_activations(case):
    w = make_weight(case, N, K, seed=7)
    x = torch.randn(2, K).bfloat16()
    out = poisoned(2, N, dtype=torch.bfloat16)
    lut_gemv(x, w, None, config=dict(BN=16, G=8), out=out)
    assert rel_err(out, reference_linear(x, w)) < BF16_RTOL


def test_split_k_counters_reset_between_calls():
    w = make_weight("nf4", N, K, seed=3)
    cfg = dict(BN=16, G=8, SPLIT_K=4)
    for _ in range(2):  # a counter left non-zero would make the second call skip its output
        x = torch.randn(2, K)
        out = poisoned(2, N, dtype=torch.float32)
        lut_gemv(x, w, None, config=cfg, out=out)
        assert rel_err(out, reference_linear(x, w)) < 1e-5


@pytest.mark.parametrize("case", ALL_CASES)
def test_gemm_matches_twin(case):
    w = make_weight(case, N, K, seed=zlib.crc32(case.encode()) % 997)
    bias = torch.randn(N).bfloat16()
    for m in (1, 17, 33):
        x = torch.randn(m, K).bfloat16()
        out = poisoned(m, N, dtype=torch.float32 if m > 1 else torch.bfloat16)
        lut_gemm(x, w, bias, config=dict(BM=16, BN=32, BK=64), out=out)
        ref = reference_linear(x, w, bias, dot_dtype=torch.bfloat16)
        if m > 1:
            ref = reference_linear(x.float(), w, bias.float(), dot_dtype=torch.bfloat16)
        assert rel_err(out, ref) < (1e-4 if m > 1 else BF16_RTOL), (case, m)


@pytest.mark.parametrize("case", ALL_CASES)
def test_gemm_split_k_matches_twin(case):
    """K split in 3 (a split may start inside a scale block), bias added once by the split
    that arrives last; a second call checks that every tile's counter was reset."""
    w = make_weight(case, N, K, seed=zlib.crc32(case.encode()) % 983)
    bias = torch.randn(N)
    for m in (2, 19):
        x = torch.randn(m, K).bfloat16()
        out = poisoned(m, N, dtype=torch.float32)
        lut_gemm(x, w, bias.bfloat16(), config=dict(BM=16, BN=16, BK=32, SPLIT_K=3), out=out)
        ref = reference_linear(x.float(), w, bias.bfloat16().float(), dot_dtype=torch.bfloat16)
        assert rel_err(out, ref) < 1e-4, (case, m)


def test_gemm_split_plan():
    assert gemm_split_plan(dict(BK=64, SPLIT_K=3), 200, 1) == (2, 128)  # 4 steps: 2 + 2
    assert gemm_split_plan(dict(BK=64, SPLIT_K=3), 1000, 1) == (3, 384)
    split, k_split = gemm_split_plan(dict(BK=64), 14336, 1)  # auto: splits fill the SMs
    assert split > 1 and k_split % 64 == 0 and split * k_split >= 14336
    assert gemm_split_plan(dict(BK=64), 14336, 10**6) == (1, 14336)  # enough tiles: none


def test_gemm_tile_smaller_than_block():
    w = make_weight("nf4", N, K, seed=11)  # B = 64 > BK = 32: one scale column per tile
    x = torch.randn(5, K).half()
    out = poisoned(5, N, dtype=torch.float32)
    lut_gemm(x, w, None, config=dict(BM=16, BN=16, BK=32), out=out)
    assert rel_err(out, reference_linear(x.float(), w, dot_dtype=torch.float16)) < 1e-4


@pytest.mark.parametrize("case", list(LUT_CASES))
def test_odd_shapes(case):
    """N and K odd (K pads to whole blocks inside the payload), M up to 257 for the tiles."""
    n, k = 37, 199
    w = make_weight(case, n, k, seed=zlib.crc32(case.encode()) % 991)
    for m in (1, 3, 16):
        x = torch.randn(m, k)
        out = poisoned(m, n, dtype=torch.float32)
        lut_gemv(x, w, None, config=dict(BN=16, G=8), out=out)
        assert rel_err(out, reference_linear(x, w)) < 1e-5, (case, m)
    x = torch.randn(257, k).bfloat16()
    out = poisoned(257, n, dtype=torch.float32)
    lut_gemm(x, w, None, config=dict(BM=64, BN=16, BK=64), out=out)
    assert rel_err(out, reference_linear(x.float(), w, dot_dtype=torch.bfloat16)) < 1e-4, case


@pytest.mark.parametrize("case", ALL_CASES)
def test_dequantize_is_the_twins_decode_rounded(case):
    """The decode launch writes every element of a NaN-poisoned [N, K] buffer with the
    twin's float32 decode rounded to bf16 / fp16 (what lut_gemm feeds tl.dot), over odd N
    and K; lut_dequant_mm then matches the twin's GEMM on the same rounding."""
    for n, k in ((N, K), (37, 199)):
        w = make_weight(case, n, k, seed=zlib.crc32(case.encode()) % 977 + n)
        for dtype in (torch.bfloat16, torch.float16):
            out = poisoned(n, k, dtype=dtype)
            dequantize(w, k, dtype, out=out)
            want = round_for_dot(w.dense(k), dtype).to(dtype)
            assert torch.equal(out, want), (case, n, k, dtype)
        x = torch.randn(33, k).bfloat16()
        bias = torch.randn(n).bfloat16()
        got = lut_dequant_mm(x, w, bias)
        ref = reference_linear(x.float(), w, bias.float(), dot_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and rel_err(got, ref) < BF16_RTOL, case
