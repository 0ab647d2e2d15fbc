"""FP8 W8A8: y[M, N] = dequant(q(x)) @ dequant(W)^T with both operands float8_e4m3fn.

Shape legend: M activation rows, N weight rows, K columns; BM x BN x BK tiles.
Two launches:
  1. `_quant_rows_kernel` (one program per row): sx[m] = max(amax(|x[m, :]|), 1e-12) / 448,
     xq[m, k] = e4m3_rne(clamp(x[m, k] / sx[m], +-448)), a dynamic per-token scale.
  2. `_w8a8_kernel`: fp8 x fp8 tl.dot accumulating in float32 (QGMMA / fp8 MMA on sm_89+).
     Weight scales: one per row (applied once at the end) or one per 128x128 tile
     (applied to each K step's partial product; invariant: BK divides 128 and BN divides
     128, so one tile of the product sees one weight scale per row).
Memory layout: x [M, K] rows contiguous; codes [N, K] rows contiguous; scales float32.
Reference twin: `reference_w8a8` (same quantization of x in torch, float32 matmul).
"""

from __future__ import annotations

import torch

from lowbit.formats.views import Fp8View
from lowbit.kernels import launch
from lowbit.kernels.runtime import interpreting, tl, triton

E4M3_MAX = 448.0


@triton.jit
def _quant_rows_kernel(x_ptr, xq_ptr, sx_ptr, M, K, stride_xm, stride_qm, BK: tl.constexpr):
    """Row m of x (rows at or past M: zeros, the padding of a GEMM that wants 16 rows)."""
    m = tl.program_id(0)
    live = m < M
    amax = tl.zeros([BK], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + m * stride_xm + kk, mask=(kk < K) & live, other=0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    s = tl.maximum(tl.max(amax, 0), 1e-12) / 448.0
    tl.store(sx_ptr + m, s)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + m * stride_xm + kk, mask=(kk < K) & live, other=0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / s, -448.0), 448.0)
        tl.store(xq_ptr + m * stride_qm + kk, q.to(tl.float8e4nv), mask=kk < K)


@triton.jit
def _scale_epilogue_kernel(y_ptr, sx_ptr, sw_ptr, b_ptr, out_ptr, N, stride_y, stride_o,
                           HAS_BIAS: tl.constexpr, BN: tl.constexpr):
    """out[m, n] = y[m, n] * sx[m] * sw[n] (+ b[n]), rounded once to out's dtype."""
    m = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = cols < N
    acc = tl.load(y_ptr + m * stride_y + cols, mask=mask, other=0) * tl.load(sx_ptr + m)
    acc = acc * tl.load(sw_ptr + cols, mask=mask, other=0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0).to(tl.float32)
    tl.store(out_ptr + m * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w8a8_kernel(
    xq_ptr, sx_ptr, w_ptr, ws_ptr, y_ptr, bias_ptr,
    M, N, K, stride_qm, stride_wn, stride_sn, stride_ym,
    BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, GROUP_M: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    ms = pid_m * BM + tl.arange(0, BM)
    rows = pid_n * BN + tl.arange(0, BN)
    mmask = ms < M
    rmask = rows < N
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        a = tl.load(xq_ptr + ms.to(tl.int64)[:, None] * stride_qm + kk[None, :],
                    mask=mmask[:, None] & (kk < K)[None, :])
        b = tl.load(w_ptr + rows.to(tl.int64)[None, :] * stride_wn + kk[:, None],
                    mask=rmask[None, :] & (kk < K)[:, None])
        a = tl.where(mmask[:, None] & (kk < K)[None, :], a, tl.zeros_like(a))
        b = tl.where(rmask[None, :] & (kk < K)[:, None], b, tl.zeros_like(b))
        if DOT_F32:  # the interpreter: same fp8 values, float32 product
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        if BLOCK_SCALES:
            s = tl.load(ws_ptr + (rows // 128) * stride_sn + k0 // 128, mask=rmask, other=0)
            acc += part * s[None, :]
        else:
            acc += part
    if not BLOCK_SCALES:
        acc *= tl.load(ws_ptr + rows * stride_sn, mask=rmask, other=0)[None, :]
    acc *= tl.load(sx_ptr + ms, mask=mmask, other=0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rmask, other=0).to(tl.float32)[None, :]
    tl.store(y_ptr + ms.to(tl.int64)[:, None] * stride_ym + rows[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & rmask[None, :])


def w8a8_refusal(x: torch.Tensor, w: Fp8View) -> str | None:
    if w.scale_kind != "f32":
        return "W8A8 reads float32 weight scales (per row or 128x128); mxfp8 goes through triton_fp8_w8a16"
    per_row = w.block_rows == 1 and w.scales.shape[-1] == 1
    if not per_row and (w.block_rows, w.block_cols) != (128, 128):
        return f"weight scale blocks {w.block_rows}x{w.block_cols} are neither per row nor 128x128"
    if x.shape[1] != w.kp:
        return "W8A8 needs x and the fp8 codes to have the same K"
    return None


def quantize_rows(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq float8_e4m3fn [R, K], sx float32 [R]) with a per-row scale; R = rows
    (default M), rows past M are zeros."""
    m, k = x.shape
    r = m if rows is None else rows
    assert r >= m
    if interpreting() or not x.is_cuda:  # triton 3.6's interpreter rounds fp32 -> e4m3 wrongly across binades
        xf = torch.cat([x.float(), x.new_zeros(r - m, k, dtype=torch.float32)]) if r > m else x.float()
        sx = (xf.abs().amax(1).clamp(min=1e-12) / E4M3_MAX).contiguous()
        xq = (xf / sx[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return xq, sx
    xq = torch.empty(r, k, dtype=torch.float8_e4m3fn, device=x.device)
    sx = torch.empty(r, dtype=torch.float32, device=x.device)
    bk = min(4096, triton.next_power_of_2(k))
    launch.run(_quant_rows_kernel, (r,), x, xq, sx, m, k, x.stride(0), xq.stride(0), BK=bk, num_warps=4)
    return xq, sx


def fp8_w8a8(x: torch.Tensor, w: Fp8View, bias: torch.Tensor | None = None,
             config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] in x.dtype."""
    assert x.dim() == 2 and x.stride(1) == 1 and w.lead == ()
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    assert w.codes.dtype == torch.float8_e4m3fn and w.codes.device == x.device
    assert w8a8_refusal(x, w) is None, w8a8_refusal(x, w)
    m, k = x.shape
    n = w.n
    block = w.scales.shape[-1] != 1 or w.block_rows != 1
    cfg = config or launch.lookup("w8a8", "fp8", n, k, m)
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    if block:
        bk, bn = min(bk, 128), min(bn, 128)
    xq, sx = quantize_rows(x)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (m, n) and y.dtype in (x.dtype, torch.float32) and y.stride(1) == 1
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    launch.run(_w8a8_kernel, grid,
        xq, sx, w.codes, w.scales, y, x if bias is None else bias,
        m, n, k, xq.stride(0), w.codes.stride(0), w.scales.stride(-2), y.stride(0),
        BLOCK_SCALES=block, HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk,
        GROUP_M=cfg.get("GROUP_M", 8), DOT_F32=interpreting(),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
    )
    return y


def scaled_mm_refusal(x: torch.Tensor, w: Fp8View) -> str | None:
    """Why scaled_mm_w8a8 cannot take this call, or None."""
    reason = w8a8_refusal(x, w)
    if reason is not None:
        return reason
    if w.scales.shape[-1] != 1 or w.block_rows != 1:
        return "torch._scaled_mm's row-wise mode reads one weight scale per row, not 128x128 blocks"
    if x.dtype != torch.bfloat16:
        return f"torch._scaled_mm's row-wise mode writes bf16, activations are {x.dtype}"
    if x.shape[1] % 16 or w.n % 16:
        return f"torch._scaled_mm needs K and N multiples of 16, got K = {x.shape[1]}, N = {w.n}"
    if w.codes.stride(-1) != 1 or w.codes.stride(-2) % 16:
        return "fp8 code rows are not 16-byte aligned"
    return None


_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    """A float32 1 on `device`, made once (a graph replays the same tensor)."""
    if device not in _ONES:
        _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return _ONES[device]


SCALED_MM_MODES = ("tensorwise", "rowwise")


def scaled_mm_w8a8(x: torch.Tensor, w: Fp8View, bias: torch.Tensor | None = None,
                   mode: str = "tensorwise") -> torch.Tensor:
    """y [M, N] in x.dtype: the W8A8 product of fp8_w8a8 (the same per-row activation
    quantization, quantize_rows, rows zero-padded to a multiple of 16) through
    torch._scaled_mm. mode "tensorwise": unit scales, a float32 product, then one epilogue
    launch applies sx [M] and the weight's row scales [N] (and the bias) and rounds once;
    "rowwise": cuBLASLt / CUTLASS's row-wise scaled GEMM writes x.dtype itself (slower at
    small M on the H200: docs/BENCHMARKS.md#kernels)."""
    assert x.dim() == 2 and w.lead == () and scaled_mm_refusal(x, w) is None and mode in SCALED_MM_MODES
    m, n = x.shape[0], w.n
    xq, sx = quantize_rows(x if x.stride(1) == 1 else x.contiguous(), rows=m + (-m % 16))
    sw = w.scales.reshape(-1).float()
    if mode == "rowwise":
        y = torch._scaled_mm(xq, w.codes.t(), scale_a=sx[:, None], out_dtype=x.dtype,
                             scale_b=sw.reshape(1, -1))[:m]
        return y if bias is None else y + bias.to(y.dtype)
    one = _one(x.device)
    y32 = torch._scaled_mm(xq, w.codes.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    if not x.is_cuda and not interpreting():
        y = y32[:m] * sx[:m, None] * sw[None, :]
        return (y if bias is None else y + bias.float()).to(x.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bn = min(1024, triton.next_power_of_2(n))
    launch.run(_scale_epilogue_kernel, (m, triton.cdiv(n, bn)), y32, sx, sw, x if bias is None else bias,
               out, n, y32.stride(0), out.stride(0), HAS_BIAS=bias is not None, BN=bn, num_warps=4)
    return out


def reference_w8a8(x: torch.Tensor, w: Fp8View, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin: the same per-row fp8 quantization of x, float32 matmul with dequantized W."""
    xf = x.float()
    sx = xf.abs().amax(1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    xq = (xf / sx).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * sx
    y = xq @ w.dense(x.shape[1]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
