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
With a packed codebook (VqWeight.packed) FC1 and FC2 run the packed K step of
lowbit.kernels.vq_gemv (`_vq_block_step`: BB scale blocks a step, one int64 gather a group,
elementwise float32 accumulators reduced once after the loop; config BB, BN, num_warps);
config PACKED: False, or a codebook that is not float16-valued, keeps the float32 gathers.
Reference twin: lowbit.kernels.moe.reference_moe (vq_decode per expert, float32).
"""

from __future__ import annotations

import torch

from lowbit.formats.views import VqWeight
from lowbit.kernels.moe_slots import combine_slots, flat_slots, moe_output
from lowbit.kernels.runtime import tl, triton
from lowbit.kernels.vq_gemv import _vq_block_step, _vq_groups

VQ_MOE_MAX_TOKENS = 64  # per-slot reads: prefill would read each expert once per routed token
DEFAULT_CONFIG = {"BN": 32, "BG": 32, "num_warps": 4}  # the float32-gather kernels
BLOCKS_CONFIG = {"BN": 32, "BB": 4, "num_warps": 4}  # the packed kernels: BB scale blocks a K step


@triton.jit
def _slot_expert(ids_ptr, E):
    """This program's slot s (grid axis 1), its expert id as int64 (0 for an id outside
    0..E-1, a slot placed nowhere) and whether the id was valid."""
    s = tl.program_id(1)
    e = tl.load(ids_ptr + s)
    valid = (e >= 0) & (e < E)
    return s, tl.where(valid, e, 0).to(tl.int64), valid


@triton.jit
def _vq_moe_fc1_blocks_kernel(
    x_ptr, h_ptr, ids_ptr, codes_ptr, scales_ptr, cbp_ptr,
    K, NB, NI, E, A, stride_xt, stride_ce, stride_cn, stride_se, stride_sn, stride_h,
    D: tl.constexpr, IB: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr, EVEN: tl.constexpr,
):
    """FC1 in the packed schedule: program (p, s) holds the gate and up rows p * BN.. of
    expert ids[s] as elementwise float32 [BN, BB, GPB] sums over the K steps, reduced once
    after the loop. EVEN: NI % BN, NB % BB are 0 and K = 64 NB."""
    GPB: tl.constexpr = 64 // D
    s, e, valid = _slot_expert(ids_ptr, E)
    t = s // A
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = n < NI
    gate_c = codes_ptr + e * stride_ce + n[:, None, None].to(tl.int64) * stride_cn
    gate_s = scales_ptr + e * stride_se + n[:, None].to(tl.int64) * stride_sn
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    one = tl.full([1], 1, tl.int1)  # the one activation row's mask
    acc_g = tl.zeros([1, BN, BB, GPB], tl.float32)
    acc_u = tl.zeros([1, BN, BB, GPB], tl.float32)
    for b0 in range(0, NB, BB):
        acc_g += _vq_block_step(x_row, one, gate_c, gate_s, nmask, cbp_ptr, b0, NB, K, D, IB, 1, BB, EVEN)
        acc_u += _vq_block_step(x_row, one, gate_c + NI * stride_cn, gate_s + NI * stride_sn, nmask, cbp_ptr, b0,
                                NB, K, D, IB, 1, BB, EVEN)
    g = tl.sum(tl.sum(tl.sum(acc_g, 3), 2), 0)
    u = tl.sum(tl.sum(tl.sum(acc_u, 3), 2), 0)
    h = tl.where(valid, g / (1.0 + tl.exp(-g)) * u, 0.0)
    tl.store(h_ptr + s.to(tl.int64) * stride_h + n, h, mask=nmask)


@triton.jit
def _vq_moe_fc2_blocks_kernel(
    h_ptr, ys_ptr, ids_ptr, w_ptr, codes_ptr, scales_ptr, cbp_ptr,
    K, NB, N, E, stride_h, stride_ce, stride_cn, stride_se, stride_sn, stride_ys,
    D: tl.constexpr, IB: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr, EVEN: tl.constexpr,
):
    """FC2 in the packed schedule: ys[s, n] = weights[s] * (h[s] . W2_e[n]). EVEN: N % BN,
    NB % BB are 0 and K = 64 NB."""
    GPB: tl.constexpr = 64 // D
    s, e, valid = _slot_expert(ids_ptr, E)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = n < N
    row_c = codes_ptr + e * stride_ce + n[:, None, None].to(tl.int64) * stride_cn
    row_s = scales_ptr + e * stride_se + n[:, None].to(tl.int64) * stride_sn
    h_row = h_ptr + s.to(tl.int64) * stride_h
    one = tl.full([1], 1, tl.int1)  # the one activation row's mask
    acc = tl.zeros([1, BN, BB, GPB], tl.float32)
    for b0 in range(0, NB, BB):
        acc += _vq_block_step(h_row, one, row_c, row_s, nmask, cbp_ptr, b0, NB, K, D, IB, 1, BB, EVEN)
    y = tl.sum(tl.sum(tl.sum(acc, 3), 2), 0)
    y = tl.where(valid, y * tl.load(w_ptr + s), 0.0)
    tl.store(ys_ptr + s.to(tl.int64) * stride_ys + n, y, mask=nmask)


@triton.jit
def _vq_moe_fc1_kernel(
    x_ptr, h_ptr, ids_ptr, codes_ptr, scales_ptr, cb_ptr,
    K, G, NI, E, A, stride_xt, stride_ce, stride_cn, stride_se, stride_sn, stride_h,
    D: tl.constexpr, IB: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr,
):
    s, e, valid = _slot_expert(ids_ptr, E)
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
    D: tl.constexpr, IB: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr,
):
    s, e, valid = _slot_expert(ids_ptr, E)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = n < N
    row_c = codes_ptr + e * stride_ce + n[:, None].to(tl.int64) * stride_cn
    row_s = scales_ptr + e * stride_se + n[:, None].to(tl.int64) * stride_sn
    acc = tl.zeros([BN], tl.float32)
    for g0 in range(0, G, BG):
        gi = g0 + tl.arange(0, BG)
        m2 = nmask[:, None] & (gi < G)[None, :]
        idx, sc = _vq_groups(row_c, row_s, gi, m2, D, IB)
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
    x, ids_flat, tw = flat_slots(x, ids, weights)
    y = moe_output(x, out)
    t, hid = x.shape
    a = ids.shape[1]
    s, e, inter = t * a, w13.lead[0], w13.n // 2
    h = torch.empty(s, inter, dtype=torch.float32, device=x.device)
    ys = torch.empty(s, hid, dtype=torch.float32, device=x.device)
    packed = (config or {}).get("PACKED", True)
    if w13.packed is not None and packed:
        cfg = {**BLOCKS_CONFIG, **(config or {})}
        bn, bb, nb = cfg["BN"], cfg["BB"], w13.kp // 64
        _vq_moe_fc1_blocks_kernel[(triton.cdiv(inter, bn), s)](
            x, h, ids_flat, w13.codes, w13.scales.view(torch.int16), w13.packed,
            hid, nb, inter, e, a, x.stride(0), w13.codes.stride(0), w13.codes.stride(1),
            w13.scales.stride(0), w13.scales.stride(1), h.stride(0), D=w13.dim, IB=w13.index_bits,
            BN=bn, BB=bb, EVEN=inter % bn == 0 and nb % bb == 0 and hid == 64 * nb, num_warps=cfg["num_warps"])
    else:
        cfg = {**DEFAULT_CONFIG, **(config or {})}
        _vq_moe_fc1_kernel[(triton.cdiv(inter, cfg["BN"]), s)](
            x, h, ids_flat, w13.codes, w13.scales.view(torch.int16), w13.codebook,
            hid, w13.kp // w13.dim, inter, e, a, x.stride(0), w13.codes.stride(0), w13.codes.stride(1),
            w13.scales.stride(0), w13.scales.stride(1), h.stride(0),
            D=w13.dim, IB=w13.index_bits, BN=cfg["BN"], BG=cfg["BG"], num_warps=cfg["num_warps"])
    if w2.packed is not None and packed:
        cfg = {**BLOCKS_CONFIG, **(config or {})}
        bn, bb, nb = cfg["BN"], cfg["BB"], w2.kp // 64
        _vq_moe_fc2_blocks_kernel[(triton.cdiv(hid, bn), s)](
            h, ys, ids_flat, tw, w2.codes, w2.scales.view(torch.int16), w2.packed,
            inter, nb, hid, e, h.stride(0), w2.codes.stride(0), w2.codes.stride(1),
            w2.scales.stride(0), w2.scales.stride(1), ys.stride(0), D=w2.dim, IB=w2.index_bits,
            BN=bn, BB=bb, EVEN=hid % bn == 0 and nb % bb == 0 and inter == 64 * nb, num_warps=cfg["num_warps"])
    else:
        cfg = {**DEFAULT_CONFIG, **(config or {})}
        _vq_moe_fc2_kernel[(triton.cdiv(hid, cfg["BN"]), s)](
            h, ys, ids_flat, tw, w2.codes, w2.scales.view(torch.int16), w2.codebook,
            inter, w2.kp // w2.dim, hid, e, h.stride(0), w2.codes.stride(0), w2.codes.stride(1),
            w2.scales.stride(0), w2.scales.stride(1), ys.stride(0),
            D=w2.dim, IB=w2.index_bits, BN=cfg["BN"], BG=cfg["BG"], num_warps=cfg["num_warps"])
    return combine_slots(ys, x, a, ids_flat, e, out=y)
