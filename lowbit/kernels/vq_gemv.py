"""Vector codebook GEMV: y[M, N] = x[M, K] @ W^T (+ bias) for M <= 16, W a `VqWeight`.

Shape legend: M activation rows (BM per program, 1 / 2 / 4), N output features (weight
rows, BN per program), K input features, Kp = K padded to 64, D weights per group,
IB index bits, C = 2**IB codebook entries, G = Kp / D groups per row (BG per K step).

Memory layout (lowbit.formats.vq, docs/FORMATS.md §3.8): codes uint8 [N, G * IB / 8],
row stride stride_cn bytes (IB = 8: one byte per group; IB = 12: groups 2j, 2j + 1 in the
24 bits of bytes 3j..3j+2, low group first); scales bfloat16 [N, Kp / 64] read as their
int16 bit pattern (bf16 -> fp32 is a 16-bit shift, exact); codebook float32 [C, D]
contiguous (4 KiB for 256 x 4, 64 KiB for 4096 x 4: it stays in L1 / L2, read by gather).

Schedule: a program owns BN rows and BM activation rows and walks all of K in steps of BG
groups: it loads the [BN, BG] indices and scales once, then for each of the D lanes of a
group gathers codebook[idx, j] * scale and multiplies it with the x values at columns
D g + j ([BM, BG]), reducing over the groups into a float32 [BM, BN] accumulator.
Invariant: columns k >= K read x as 0 (padding never reaches y), rows n >= N and groups
g >= G are masked, so the kernel reads no byte outside the tensors.
With the packed codebook (VqWeight.packed: float16 entries as one int64 each; every shipped
codebook) the kernel's PACKED form runs: one gather a group, lanes split by shifts,
x read as contiguous [BM, BG * D] tiles (config PACKED: False keeps the float32 gathers).
Reference twin: `reference_vq_linear` (decode with lowbit.formats.vq.vq_decode, float32
matmul).
"""

from __future__ import annotations

import torch

from lowbit.formats.views import VqWeight
from lowbit.kernels.runtime import tl, triton

GEMV_MAX_M = 16  # rows a launch takes (BM = 4 per program, more programs along M)
DEFAULT_CONFIG = {"BN": 32, "BG": 32, "num_warps": 4}


@triton.jit
def _vq_groups(row_codes, row_scales, gi, m2, D: tl.constexpr, IB: tl.constexpr):
    """Indices int32 [BN, BG] and float32 scales [BN, BG] of groups gi of the rows whose code
    and scale rows start at row_codes / row_scales [BN, 1] (pointers)."""
    if IB == 12:
        pb = row_codes + 3 * (gi // 2)[None, :]
        v = tl.load(pb, mask=m2, other=0).to(tl.int32)
        v = v | (tl.load(pb + 1, mask=m2, other=0).to(tl.int32) << 8)
        v = v | (tl.load(pb + 2, mask=m2, other=0).to(tl.int32) << 16)
        idx = tl.where((gi % 2 == 0)[None, :], v & 0xFFF, v >> 12)
    else:
        idx = tl.load(row_codes + gi[None, :], mask=m2, other=0).to(tl.int32)
    sbits = tl.load(row_scales + (gi * D // 64)[None, :], mask=m2, other=0).to(tl.int32) & 0xFFFF
    return idx, (sbits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _vq_packed_rows(cbp_ptr, idx, sc, m2, D: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr):
    """The weights [BN, BG * D] of groups idx [BN, BG] (scales sc) from the packed codebook:
    one int64 gather a group, its float16 lanes split by shifts (the gemv below, the MoE kernels of lowbit.kernels.vq_moe)."""
    lanes = tl.arange(0, D)
    word = tl.load(cbp_ptr + idx, mask=m2, other=0)  # int64 [BN, BG]
    half = ((word[:, :, None] >> (16 * lanes)[None, None, :].to(tl.int64)) & 0xFFFF).to(tl.int16)
    wv = half.to(tl.float16, bitcast=True).to(tl.float32) * sc[:, :, None]
    return tl.reshape(wv, [BN, BG * D])


@triton.jit
def _vq_gemv_kernel(
    x_ptr, y_ptr, bias_ptr, codes_ptr, scales_ptr, cb_ptr,
    M, N, K, G, stride_xm, stride_ym, stride_cn, stride_sn,
    D: tl.constexpr, IB: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr, PACKED: tl.constexpr,
):
    """PACKED: cb_ptr is the packed codebook (one int64 gather a group, lanes split by
    shifts, x read as one contiguous [BM, BG * D] tile); else the float32 codebook, D
    gathers a group."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)  # [BN]
    rmask = rows < N
    ms = pid_m * BM + tl.arange(0, BM)  # [BM]
    mmask = ms < M
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for g0 in range(0, G, BG):
        gi = g0 + tl.arange(0, BG)  # [BG]
        m2 = rmask[:, None] & (gi < G)[None, :]  # [BN, BG]
        idx, s = _vq_groups(codes_ptr + rows[:, None].to(tl.int64) * stride_cn,
                            scales_ptr + rows[:, None].to(tl.int64) * stride_sn, gi, m2, D, IB)  # [BN, BG]
        if PACKED:
            w2 = _vq_packed_rows(cb_ptr, idx, s, m2, D, BN, BG)  # [BN, BG * D]
            col = tl.reshape(gi[:, None] * D + tl.arange(0, D)[None, :], [BG * D])
            xm = mmask[:, None] & (col < K)[None, :]
            x2 = tl.load(x_ptr + ms[:, None] * stride_xm + col[None, :], mask=xm,
                         other=0.0).to(tl.float32)  # [BM, BG * D]
            acc += tl.sum(w2[None, :, :] * x2[:, None, :], axis=2)  # [BM, BN]
        else:
            for j in tl.static_range(D):
                wv = tl.load(cb_ptr + idx * D + j, mask=m2, other=0.0) * s  # [BN, BG]
                col = gi * D + j  # [BG]
                xm = mmask[:, None] & (col < K)[None, :]
                xv = tl.load(x_ptr + ms[:, None] * stride_xm + col[None, :], mask=xm,
                             other=0.0).to(tl.float32)  # [BM, BG]
                acc += tl.sum(wv[None, :, :] * xv[:, None, :], axis=2)  # [BM, BN]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rmask, other=0).to(tl.float32)[None, :]
    yp = y_ptr + ms[:, None] * stride_ym + rows[None, :]
    tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & rmask[None, :])


def vq_gemv_refusal(x: torch.Tensor, w: VqWeight, bias: torch.Tensor | None = None) -> str | None:
    """Why vq_gemv cannot take this call, or None."""
    if w.lead != ():
        return "weight is stacked; the gemv takes [N, K]"
    if x.dim() != 2 or x.shape[0] > GEMV_MAX_M:
        return f"the vq gemv takes x [M <= {GEMV_MAX_M}, K], got {list(x.shape)}"
    if x.shape[1] > w.kp:
        return f"x has {x.shape[1]} columns but the weight stores {w.kp}"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations are {x.dtype}"
    if w.index_bits not in (8, 12):
        return f"{w.index_bits}-bit indices have no kernel"
    if w.codes.stride(-1) != 1 or w.scales.stride(-1) != 1 or not w.codebook.is_contiguous():
        return "codes, scales and codebook rows must be contiguous"
    if w.codebook.dtype != torch.float32 or w.scales.dtype != torch.bfloat16:
        return f"codebook {w.codebook.dtype} / scales {w.scales.dtype}: expected float32 / bfloat16"
    if bias is not None and (tuple(bias.shape) != (w.n,) or not bias.is_floating_point()):
        return f"bias is {bias.dtype} {list(bias.shape)}, expected a float [{w.n}]"
    devices = {t.device for t in (x, w.codes, w.scales, w.codebook)}
    if len(devices) != 1:
        return f"tensors on several devices: {sorted(str(d) for d in devices)}"
    return None


def vq_gemv(x: torch.Tensor, w: VqWeight, bias: torch.Tensor | None = None,
            config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] in x.dtype (schedule and layout: module docstring); into out [M, N] (row
    stride free, last dim contiguous) when given."""
    reason = vq_gemv_refusal(x, w, bias)
    if reason is not None:
        raise ValueError(f"vq_gemv: {reason}")
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    m, k = x.shape
    n = w.n
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (m, n) and y.dtype == x.dtype and y.stride(-1) == 1, "out must be [M, N] in x.dtype"
    bm = 1 if m == 1 else (2 if m == 2 else 4)
    groups = w.kp // w.dim
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, bm))
    packed = w.packed is not None and cfg.get("PACKED", True)
    _vq_gemv_kernel[grid](
        x, y, x if bias is None else bias.contiguous(), w.codes, w.scales.view(torch.int16),
        w.packed if packed else w.codebook, m, n, k, groups, x.stride(0), y.stride(0), w.codes.stride(-2),
        w.scales.stride(-2), D=w.dim, IB=w.index_bits, HAS_BIAS=bias is not None, BM=bm,
        BN=cfg["BN"], BG=cfg["BG"], PACKED=packed, num_warps=cfg["num_warps"],
    )
    return y


def reference_vq_linear(x: torch.Tensor, w: VqWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin: decode with the format's reference, matmul in float32, cast to x.dtype."""
    y = x.float() @ w.dense(x.shape[-1]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
