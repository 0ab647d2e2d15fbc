"""Decode a quantized weight once, then a library GEMM (linear route triton_lut_dequant).

At prefill sizes the in-register gemm decodes the same weight once per M tile on CUDA
cores; one launch that writes W [N, K] in the activation dtype, then cuBLAS, costs the
decode once per call (docs/BENCHMARKS.md#kernels, "Prefill linears"). The decode and its
rounding are the gemm's (decode.dequant_tile), so both match the same twin.
"""

from __future__ import annotations

import torch

from lowbit.formats.views import Fp8View, LutWeight
from lowbit.kernels import launch
from lowbit.kernels.decode import dequant_tile, row_tables, weight_args
from lowbit.kernels.dequant_gemm import _check
from lowbit.kernels.runtime import tl, triton


@triton.jit
def _dequant_kernel(
    w_ptr, codes_ptr, table_ptr, tidx_ptr, ab_ptr, scales_ptr, offs_ptr,
    N, K, KC, stride_wn, stride_cn, stride_sn, stride_on, g,
    BITS: tl.constexpr, DECODE: tl.constexpr, SCALE_KIND: tl.constexpr, B: tl.constexpr,
    SROWS: tl.constexpr, HAS_TIDX: tl.constexpr, HAS_AB: tl.constexpr, HAS_OFFS: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr,
):
    """Program (n, k): W [N, K] tile rows n * BN .. + BN, columns k * BK .. + BK decoded as
    _gemm_kernel decodes it (dequant_tile), rounded to W's dtype."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    rmask = rows < N
    t, alpha, beta = row_tables(tidx_ptr, ab_ptr, rows, rmask, BN, HAS_TIDX, HAS_AB)
    w = dequant_tile(codes_ptr, table_ptr, scales_ptr, offs_ptr, rows.to(tl.int64) * stride_cn,
                     t * (1 << BITS), alpha, beta, (rows // SROWS).to(tl.int64) * stride_sn,
                     rows.to(tl.int64) * stride_on, rmask, k0, KC, g,
                     BN, BK, BITS, DECODE, SCALE_KIND, B, HAS_AB, HAS_OFFS)
    kk = k0 + tl.arange(0, BK)
    tl.store(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + kk[None, :],
             w.to(w_ptr.dtype.element_ty), mask=rmask[:, None] & (kk < K)[None, :])


DEQUANT_BN, DEQUANT_BK = 64, 128


def dequantize(w: LutWeight | Fp8View, k: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, k] in dtype (bf16 / fp16), decoded on the device in one launch: the weight a
    tensor-core library GEMM reads when M is large enough that decoding once and running
    cuBLAS beats decoding inside every M tile (linear route triton_lut_dequant)."""
    assert w.lead == () and k <= w.kp
    a = weight_args(w)
    n = w.n
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=a.codes.device)
    assert out.shape == (n, k) and out.dtype == dtype and out.stride(1) == 1
    launch.run(_dequant_kernel, (triton.cdiv(n, DEQUANT_BN), triton.cdiv(k, DEQUANT_BK)),
        out, a.codes, a.table, a.tidx, a.ab, a.scales, a.offs,
        n, k, a.kc, out.stride(0), a.stride_cn, a.stride_sn, a.stride_on, a.g,
        BITS=a.bits, DECODE=a.decode, SCALE_KIND=a.scale_kind, B=a.block, SROWS=a.srows,
        HAS_TIDX=a.has_tidx, HAS_AB=a.has_ab, HAS_OFFS=a.has_offs,
        BN=DEQUANT_BN, BK=DEQUANT_BK, num_warps=4)
    return out


def lut_dequant_mm(x: torch.Tensor, w: LutWeight | Fp8View,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] in x.dtype = x @ dequantize(W)^T + bias: one decode launch, then cuBLAS."""
    _check(x, w, bias)
    assert x.dtype in (torch.bfloat16, torch.float16), "the library GEMM reads bf16 / fp16"
    dense = dequantize(w, x.shape[1], x.dtype)
    return torch.nn.functional.linear(x, dense, None if bias is None else bias.to(x.dtype))
