"""Fused MoE decode over vector codebook experts (vq2 / vq3 / vq4 stacks): per-slot GEMVs.

Shape legend: T tokens, A top-k, S = T * A slots (slot s = t * A + j), H hidden, I expert
width, E experts; for a stack, N rows, K input columns, Kp = K padded to 64, D weights per
group, IB index bits, G = Kp / D groups per row (BG per K step), BN output rows per program.
  y = vq_moe(x [T, H], ids [T, A], weights [T, A], w13 VqWeight [E, 2I, H], w2 VqWeight [E, H, I])
    y[t] = sum_j weights[t, j] * W2_e (SiLU(Wg_e x[t]) * Wu_e x[t]),  e = ids[t, j]

Memory layout (lowbit.formats.vq, docs/FORMATS.md §3.8), per expert e as in
lowbit.kernels.vq_gemv: codes uint8 [E, N, G * IB / 8] (IB = 12: groups 2j, 2j + 1 in the 24
bits of bytes 3j..3j+2, low group first), scales bfloat16 [E, N, Kp / 64] read as int16 bits,
codebook float32 [C, D] shared by all experts (in L1 / L2). w13 and w2 may be different vq
formats (their own D, IB and codebook).

Three launches, expert ids read on the device (no host read: graph-safe; the grid depends
on S, I and H only):
  1. FC1: grid (I / BN, S). Program (p, s) decodes rows p*BN.. of expert ids[s]'s gate half
     and the same rows of its up half, both over all K, against x[s // A]; writes
     h[s, n] = SiLU(gate) * up, float32 [S, I].
  2. FC2: grid (H / BN, S). ys[s, n] = weights[s] * (h[s] . W2_e[n]), float32 [S, H].
  3. combine (lowbit.kernels.moe_slots.combine_slots): y[t] = sum_j ys[t * A + j] in order.
A slot whose id is outside 0..E-1 (placed nowhere) reads expert 0 and writes zeros, and the
combine never reads it. Each slot reads its expert's weights once: T tokens routed to one
expert read it T times (a decode kernel: the route takes T <= VQ_MOE_MAX_TOKENS).
With a packed codebook (VqWeight.packed) a group is one int64 gather, as in
lowbit.kernels.vq_gemv (config PACKED: False keeps the float32 gathers).
Reference twin: lowbit.kernels.moe.reference_moe (vq_decode per expert, float32).
"""

from __future__ import annotations

import torch

from lowbit.formats.views import VqWeight
from lowbit.kernels.moe_slots import combine_slots, flat_slots, moe_output
from lowbit.kernels.runtime import tl, triton
from lowbit.kernels.vq_gemv import _vq_groups, _vq_packed_rows

VQ_MOE_MAX_TOKENS = 64  # per-slot reads: prefill would read each expert once per routed token
DEFAULT_CONFIG = {"BN": 32, "BG": 32, "num_warps": 4}


@triton.jit
def _vq_moe_fc1_kernel(
    x_ptr, h_ptr, ids_ptr, codes_ptr, scales_ptr, cb_ptr,
    K, G, NI, E, A, stride_xt, stride_ce, stride_cn, stride_se, stride_sn, stride_h,
    D: tl.constexpr, IB: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr, PACKED: tl.constexpr,
):
    s = tl.program_id(1)
    e = tl.load(ids_ptr + s)
    valid = (e >= 0) & (e < E)
    e = tl.where(valid, e, 0).to(tl.int64)
    t = s // A
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = n < NI
    gate_c = codes_ptr + e * stride_ce + n[:, None].to(tl.int64) * stride_cn
    gate_s = scales_ptr + e * stride_se + n[:, None].to(tl.int64) * stride_sn
    up_c = gate_c + NI * stride_cn
    up_s = gate_s + NI * stride_sn
    acc_g = tl.zeros([BN], tl.float32)
    acc_u = tl.zeros([BN], tl.float32)
    for g0 in range(0, G, BG):
        gi = g0 + tl.arange(0, BG)
        m2 = nmask[:, None] & (gi < G)[None, :]
        ig, sg = _vq_groups(gate_c, gate_s, gi, m2, D, IB)
        iu, su = _vq_groups(up_c, up_s, gi, m2, D, IB)
        if PACKED:
            col = tl.reshape(gi[:, None] * D + tl.arange(0, D)[None, :], [BG * D])
            xv = tl.load(x_ptr + t * stride_xt + col, mask=col < K, other=0.0).to(tl.float32)  # [BG * D]
            acc_g += tl.sum(_vq_packed_rows(cb_ptr, ig, sg, m2, D, BN, BG) * xv[None, :], 1)
            acc_u += tl.sum(_vq_packed_rows(cb_ptr, iu, su, m2, D, BN, BG) * xv[None, :], 1)
        else:
            for j in tl.static_range(D):
                col = gi * D + j
                xv = tl.load(x_ptr + t * stride_xt + col, mask=col < K, other=0.0).to(tl.float32)  # [BG]
                wg = tl.load(cb_ptr + ig * D + j, mask=m2, other=0.0) * sg
                wu = tl.load(cb_ptr + iu * D + j, mask=m2, other=0.0) * su
                acc_g += tl.sum(wg * xv[None, :], 1)
                acc_u += tl.sum(wu * xv[None, :], 1)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    h = tl.where(valid, h, 0.0)
    tl.store(h_ptr + s.to(tl.int64) * stride_h + n, h, mask=nmask)


@triton.jit
def _vq_moe_fc2_kernel(
    h_ptr, ys_ptr, ids_ptr, w_ptr, codes_ptr, scales_ptr, cb_ptr,
    K, G, N, E, stride_h, stride_ce, stride_cn, stride_se, stride_sn, stride_ys,
    D: tl.constexpr, IB: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr, PACKED: tl.constexpr,
):
    s = tl.program_id(1)
    e = tl.load(ids_ptr + s)
    valid = (e >= 0) & (e < E)
    e = tl.where(valid, e, 0).to(tl.int64)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = n < N
    row_c = codes_ptr + e * stride_ce + n[:, None].to(tl.int64) * stride_cn
    row_s = scales_ptr + e * stride_se + n[:, None].to(tl.int64) * stride_sn
    acc = tl.zeros([BN], tl.float32)
    for g0 in range(0, G, BG):
        gi = g0 + tl.arange(0, BG)
        m2 = nmask[:, None] & (gi < G)[None, :]
        idx, sc = _vq_groups(row_c, row_s, gi, m2, D, IB)
        if PACKED:
            col = tl.reshape(gi[:, None] * D + tl.arange(0, D)[None, :], [BG * D])
            hv = tl.load(h_ptr + s.to(tl.int64) * stride_h + col, mask=col < K, other=0.0)  # [BG * D]
            acc += tl.sum(_vq_packed_rows(cb_ptr, idx, sc, m2, D, BN, BG) * hv[None, :], 1)
        else:
            for j in tl.static_range(D):
                col = gi * D + j
                hv = tl.load(h_ptr + s.to(tl.int64) * stride_h + col, mask=col < K, other=0.0)  # [BG]
                wv = tl.load(cb_ptr + idx * D + j, mask=m2, other=0.0) * sc
                acc += tl.sum(wv * hv[None, :], 1)
    acc = tl.where(valid, acc * tl.load(w_ptr + s), 0.0)
    tl.store(ys_ptr + s.to(tl.int64) * stride_ys + n, acc, mask=nmask)


def vq_moe_refusal(x: torch.Tensor, ids: torch.Tensor, w13, w2) -> str | None:
    """Why vq_moe cannot take this call (SiLU experts, no biases: the moe op checks those),
    or None."""
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, VqWeight):
            return f"{name} is {type(w).__name__}, not a vector codebook stack"
        if len(w.lead) != 1:
            return f"{name} is not a stack of experts [E, N, K]"
        if w.index_bits not in (8, 12):
            return f"{name} has {w.index_bits}-bit indices: no kernel reads them"
        if w.codes.stride(-1) != 1 or w.scales.stride(-1) != 1 or not w.codebook.is_contiguous():
            return f"{name}: codes, scales and codebook rows must be contiguous"
        if w.codebook.dtype != torch.float32 or w.scales.dtype != torch.bfloat16:
            return f"{name}: codebook {w.codebook.dtype} / scales {w.scales.dtype}, expected float32 / bfloat16"
        if w.codebook.device != x.device or w.codes.device != x.device:
            return f"{name} is on {w.codes.device}, activations on {x.device}"
    if w13.lead != w2.lead:
        return "w13 and w2 have different expert counts"
    if w13.n % 2 or w13.kp < x.shape[1] or w2.n != x.shape[1] or w2.kp < w13.n // 2:
        return f"shapes disagree: x {list(x.shape)}, w13 [{w13.n}, {w13.kp}], w2 [{w2.n}, {w2.kp}]"
    if ids.shape[0] > VQ_MOE_MAX_TOKENS:
        return f"{ids.shape[0]} tokens: the per-slot vq kernels take <= {VQ_MOE_MAX_TOKENS}"
    return None


def vq_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: VqWeight, w2: VqWeight,
           config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, H] in x.dtype, or into out (x.dtype or float32); see the module docstring."""
    reason = vq_moe_refusal(x, ids, w13, w2)
    if reason is not None:
        raise ValueError(f"vq_moe: {reason}")
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    x, ids_flat, tw = flat_slots(x, ids, weights)
    y = moe_output(x, out)
    t, hid = x.shape
    a = ids.shape[1]
    s, e, inter = t * a, w13.lead[0], w13.n // 2
    h = torch.empty(s, inter, dtype=torch.float32, device=x.device)
    ys = torch.empty(s, hid, dtype=torch.float32, device=x.device)
    bn, bg, warps = cfg["BN"], cfg["BG"], cfg["num_warps"]
    p13 = w13.packed is not None and cfg.get("PACKED", True)
    p2 = w2.packed is not None and cfg.get("PACKED", True)
    _vq_moe_fc1_kernel[(triton.cdiv(inter, bn), s)](
        x, h, ids_flat, w13.codes, w13.scales.view(torch.int16), w13.packed if p13 else w13.codebook,
        hid, w13.kp // w13.dim, inter, e, a, x.stride(0), w13.codes.stride(0), w13.codes.stride(1),
        w13.scales.stride(0), w13.scales.stride(1), h.stride(0),
        D=w13.dim, IB=w13.index_bits, BN=bn, BG=bg, PACKED=p13, num_warps=warps)
    _vq_moe_fc2_kernel[(triton.cdiv(hid, bn), s)](
        h, ys, ids_flat, tw, w2.codes, w2.scales.view(torch.int16), w2.packed if p2 else w2.codebook,
        inter, w2.kp // w2.dim, hid, e, h.stride(0), w2.codes.stride(0), w2.codes.stride(1),
        w2.scales.stride(0), w2.scales.stride(1), ys.stride(0),
        D=w2.dim, IB=w2.index_bits, BN=bn, BG=bg, PACKED=p2, num_warps=warps)
    return combine_slots(ys, x, a, ids_flat, e, out=y)
