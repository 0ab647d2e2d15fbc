"""Dequantizing GEMV / GEMM: y[M, N] = x[M, K] @ W^T (+ bias), W read packed.

Shape legend: M activation rows, N output features (weight rows), K input features,
KC code columns stored per row (KC >= K: formats pad K to whole blocks), B codes per scale.
W is a LUT view (3/4-bit codes, lowbit.kernels.decode has the byte layout), fp8 codes
with per-row / 128x128 / per-32 E8M0 scales, never an expanded bf16 copy.

Two schedules:
  gemv (M <= 16): CUDA-core FMAs in fp32. A program owns BN rows and a K range
    (split-K when N / BN programs cannot fill the SMs). Its tile [BN, BK] is laid out
    with threads along K and rows in registers, so each thread reuses its slice of x for
    BN rows; products are summed per CH codes (one scale each) inside a thread and
    scaled there; the cross-thread reduction runs once, after the K loop.
    Split-K is deterministic: each split writes its partial to a workspace [S, M, N],
    then bumps a per-N-tile counter; the split that arrives last sums the S partials in
    split order, adds the bias, writes y and resets the counter (so CUDA-graph replays
    find it at 0). Invariant: one launch at a time per device uses the counters.
  gemm (any M, meant for M > 16): tiles [BM, BN, BK]; the weight tile is decoded in
    registers to float32, scaled, cast to the activation dtype and fed to tl.dot.
Reference twin: `reference_linear` (decode with the format's twin, matmul in float32).
"""

from __future__ import annotations

import torch

from lowbit.formats.views import DenseWeight, Fp8View, LutWeight
from lowbit.kernels import launch
from lowbit.kernels.decode import (
    dot_tile,
    dot_tile_post,
    e2m1_bf16,
    e2m1_word,
    exact_tiles,
    lane_value,
    load_scales,
    row_tables,
    split_lanes,
    weight_args,
)
from lowbit.kernels.runtime import (
    interpreting,
    round_for_dot,
    semaphore,
    sm_count,
    tl,
    triton,
)
from lowbit.kernels.weights import DECODE_NAMES

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def gated_act(gate, up, SWIGLU: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """The experts' gated activation, float32 (lowbit.kernels.moe_op.MoeActivation):
    SWIGLU False: SiLU(gate) * up; True (gpt-oss): gate' = min(gate, LIMIT),
    up' = clamp(up, -LIMIT, LIMIT), gate' * sigmoid(ALPHA * gate') * (up' + 1).
    The sigmoid is exp(-|z|)-based, so large |z| cannot overflow."""
    if SWIGLU:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        z = gate * ALPHA
        ez = tl.exp(-tl.abs(z))
        return gate * tl.where(z >= 0, 1.0 / (1.0 + ez), ez / (1.0 + ez)) * (up + 1.0)
    ez = tl.exp(-tl.abs(gate))  # SiLU without overflow: x * sigmoid(x)
    return gate * tl.where(gate >= 0, 1.0 / (1.0 + ez), ez / (1.0 + ez)) * up


@triton.jit
def _row_dot(v0, v1, v2, v3, v4, v5, v6, v7, x_row_ptr, xoff, kmask, rb, half,
             CPW: tl.constexpr, HAS_AB: tl.constexpr, ACT: tl.constexpr,
             SWIGLU: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """One activation row against the decoded words: p [G, BN] (+ beta/alpha * the row's sum
    per word, so that the affine decode's beta needs no separate accumulator) and xs [G].
    ACT: the row is gated_act(row[:half], row[half:]) (the MoE FC1 output), made on load."""
    x = tl.load(x_row_ptr + xoff, mask=kmask, other=0).to(tl.float32)  # [G, CPW]
    if ACT:
        up = tl.load(x_row_ptr + half + xoff, mask=kmask, other=0).to(tl.float32)
        x = gated_act(x, up, SWIGLU, LIMIT, ALPHA)
    x0, x1, x2, x3, x4, x5, x6, x7 = split_lanes(x, CPW)
    # one multiply-add chain (FMUL then FFMAs): a sum of pairwise products costs FADDs too
    p = v0 * x0[:, None]
    p = p + v1 * x1[:, None]
    xs = x0 + x1
    if CPW >= 4:
        p = p + v2 * x2[:, None]
        p = p + v3 * x3[:, None]
        xs += x2 + x3
    if CPW == 8:
        p = p + v4 * x4[:, None]
        p = p + v5 * x5[:, None]
        p = p + v6 * x6[:, None]
        p = p + v7 * x7[:, None]
        xs += x4 + x5 + x6 + x7
    if HAS_AB == 2:  # E2M1 (HAS_AB 1) has no beta: no row-sum term
        p += xs[:, None] * rb
    return p, xs


@triton.jit
def _bias_col(bias_ptr, e, rows, rmask, N, tw_ptr, pid_m, MOE: tl.constexpr):
    """[BN, 1] float32 bias of the output rows: bias[rows] (MOE 0); expert e's bias[e, rows]
    of a contiguous [E, N] stack (MOE 1); that times the routing weight tw[pid_m] (MOE 2, so
    that the slot's output is tw * (W2 act + b2))."""
    if MOE == 0:
        b = tl.load(bias_ptr + rows, mask=rmask, other=0).to(tl.float32)
    else:
        b = tl.load(bias_ptr + e * N + rows, mask=rmask, other=0).to(tl.float32)
        if MOE == 2:
            b = b * tl.load(tw_ptr + pid_m)
    return b[:, None]


@triton.jit
def _publish(ws_ptr, part, val, mask, pid_k, MN, sem_ptr, tile):
    """Write this split's partial to the workspace [S, M, N] and arrive at the tile's counter
    (acq_rel: the writes above are visible to whoever sees the count); returns how many
    had arrived before."""
    tl.store(ws_ptr + pid_k * MN + part, val, mask=mask)
    tl.debug_barrier()
    return tl.atomic_add(sem_ptr + tile, 1, sem="acq_rel", scope="gpu")


@triton.jit
def _sum_splits(ws_ptr, part, mask, MN, SPLIT_K, acc):
    """acc + the SPLIT_K partials at part, in split order (deterministic; read from L2)."""
    for sk in range(SPLIT_K):
        acc += tl.load(ws_ptr + sk * MN + part, mask=mask, other=0, cache_modifier=".cg")
    return acc


@triton.jit
def _word_scales(scales_ptr, wi, srow_off, m2, CPW: tl.constexpr, B: tl.constexpr,
                 SCALE_KIND: tl.constexpr, DECODE: tl.constexpr):
    """float32 [G, BN] scale of each word's block; dense weights have none (1.0)."""
    if DECODE == 4:
        s = 1.0
    else:
        s = load_scales(scales_ptr, (wi * CPW) // B, srow_off, m2, SCALE_KIND)
    return s


@triton.jit
def _load_words(codes_ptr, row_off, wi, m2, BITS: tl.constexpr):
    """int32 [G, BN]: 32-bit code words (3-bit: 24-bit groups assembled from 3 bytes)."""
    if BITS == 3:
        pb = codes_ptr + row_off[None, :] + 3 * wi[:, None]
        w = tl.load(pb, mask=m2, other=0).to(tl.int32)
        w = w | (tl.load(pb + 1, mask=m2, other=0).to(tl.int32) << 8)
        w = w | (tl.load(pb + 2, mask=m2, other=0).to(tl.int32) << 16)
    else:
        w = tl.load(codes_ptr + row_off[None, :] + wi[:, None], mask=m2, other=0)
    return w


@triton.jit
def _gemv_kernel(
    x_ptr, y_ptr, bias_ptr, ws_ptr, sem_ptr,
    codes_ptr, table_ptr, tidx_ptr, ab_ptr, scales_ptr, offs_ptr,
    M, N, K, KW, w_split, stride_xm, stride_ym, stride_cw, stride_sn, stride_on, g, one_bits,
    ids_ptr, tw_ptr, A, stride_ce, stride_te, stride_se, stride_oe, SPLIT_K, order_ptr,
    sh_base, sh_ce, sh_cw, sh_gap,
    BITS: tl.constexpr, DECODE: tl.constexpr, SCALE_KIND: tl.constexpr, B: tl.constexpr,
    SROWS: tl.constexpr, HAS_TIDX: tl.constexpr, HAS_AB: tl.constexpr, HAS_OFFS: tl.constexpr,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr, MOE: tl.constexpr,
    SWIGLU: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr, COMBINE: tl.constexpr,
    ORDER: tl.constexpr, NSH: tl.constexpr,
):
    # MOE = 1 (expert FC1) / 2 (expert FC2): program axis 2 is a routed slot s (BM = 1);
    # the weight is expert ids[s] of a stack, the activation row is x[s // A] (FC1) or
    # gated_act(h[s, :K], h[s, K:]) (FC2, h = the FC1 output, rows of 2K; SWIGLU, LIMIT,
    # ALPHA pick the activation), and FC2 scales its output by the routing weight tw[s].
    # COMBINE (MOE 2): y is [T, N] and row t the ordered sum of its A slots (the program
    # that arrives last among the token's A x SPLIT_K sums them), so no combine launch.
    # HAS_BIAS in MOE modes: bias is the expert stack [E, N] (contiguous), row ids[s] added
    # before the routing weight. Outputs are per slot: y [S, N].
    # ORDER (MOE modes): program axis 2 takes slot order[i], the slots sorted by expert, so the
    # programs reading one expert's weights run next to each other (its repeats hit L2).
    # NSH > 0 (MOE modes, dense weights; not with ORDER or HAS_BIAS): each token has A + NSH
    # slots, s = t * (A + NSH) + j; slots j < A are routed (ids / tw at t * A + j), slot
    # A + c is shared expert c at weight 1.0, read from another tensor: row r of its matrix
    # at word sh_base + c * sh_ce + r * sh_cw + (r >= N / 2) * sh_gap, sh_base counted from
    # codes_ptr (DeepSeek's merged [gate | up] rows: sh_gap jumps from expert c's gate rows
    # to its up rows; the down projection's column block c: sh_ce = I, sh_gap = 0).
    # y[m, n] = g * alpha_n * sum_w s[w, n] * (p[w, n] + beta_n / alpha_n * xs[w]) + sum_w o * xs
    # codes per 32-bit word (3-bit: per 24-bit group; dense bf16: 2 weights per word)
    CPW: tl.constexpr = 2 if BITS == 16 else (4 if BITS == 8 else 8)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    if ORDER:
        pid_m = tl.load(order_ptr + pid_m)
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    e = 0
    xrow = pid_m * BM
    AT = A + NSH  # slots a token
    slot_w = 1.0
    if MOE > 0:
        if NSH == 0:
            e = tl.load(ids_ptr + pid_m).to(tl.int64)
            if MOE == 2:
                slot_w = tl.load(tw_ptr + pid_m)
        else:
            j = pid_m % AT
            routed = j < A
            r_slot = (pid_m // AT) * A + j
            e = tl.load(ids_ptr + r_slot, mask=routed, other=0).to(tl.int64)
            if MOE == 2:
                slot_w = tl.load(tw_ptr + r_slot, mask=routed, other=1.0)
        if MOE == 1:
            xrow = pid_m // AT
    row_off = e * stride_ce + rows.to(tl.int64) * stride_cw
    if NSH > 0:
        sh_row = (sh_base + (j - A).to(tl.int64) * sh_ce + rows.to(tl.int64) * sh_cw
                  + tl.where(rows >= N // 2, sh_gap, 0))
        row_off = tl.where(routed, row_off, sh_row)
    srow_off = e * stride_se + (rows // SROWS).to(tl.int64) * stride_sn
    orow_off = e * stride_oe + rows.to(tl.int64) * stride_on
    if HAS_TIDX:
        t = tl.load(tidx_ptr + e * stride_te + rows, mask=rmask, other=0)
    else:
        t = tl.zeros([BN], tl.int32)
    tb = (t * (1 << BITS))[None, :]
    ACT: tl.constexpr = MOE == 2
    if HAS_AB:
        alpha = tl.load(ab_ptr + 2 * t)
        rb = (tl.load(ab_ptr + 2 * t + 1) / alpha)[None, :]
    else:
        alpha = tl.full([BN], 1.0, tl.float32)
        rb = tl.zeros([1, BN], tl.float32)
    m0 = pid_m * BM
    acc0 = tl.zeros([G, BN], tl.float32)
    acc1 = tl.zeros([G, BN], tl.float32)
    acc2 = tl.zeros([G, BN], tl.float32)
    acc3 = tl.zeros([G, BN], tl.float32)
    aco0 = tl.zeros([G, BN], tl.float32)
    aco1 = tl.zeros([G, BN], tl.float32)
    aco2 = tl.zeros([G, BN], tl.float32)
    aco3 = tl.zeros([G, BN], tl.float32)
    j = tl.arange(0, G)
    gl = (j % 8) * (G // 8) + j // 8  # words of a tile in a permuted order: one word per thread
    lane = tl.arange(0, CPW)
    wi = pid_k * w_split + gl  # [G] word index along the row
    m2 = (wi < KW)[:, None] & rmask[None, :]
    w = _load_words(codes_ptr, row_off, wi, m2, BITS)
    s = _word_scales(scales_ptr, wi, srow_off, m2, CPW, B, SCALE_KIND, DECODE)  # [G, BN]
    for _kw in range(0, w_split, G):
        if PREFETCH:  # the next tile's loads are in flight while this one is decoded
            wi_n = wi + G
            m2_n = (wi_n < KW)[:, None] & rmask[None, :]
            w_n = _load_words(codes_ptr, row_off, wi_n, m2_n, BITS)
            s_n = _word_scales(scales_ptr, wi_n, srow_off, m2_n, CPW, B, SCALE_KIND, DECODE)
        if DECODE == 2:  # E2M1: the word's 8 codes at once
            v0, v1, v2, v3, v4, v5, v6, v7 = e2m1_word(w, ASM)
        else:
            v0 = lane_value(w, 0, BITS, DECODE, table_ptr, tb, one_bits, ASM)
            v1 = lane_value(w, 1, BITS, DECODE, table_ptr, tb, one_bits, ASM)
            if CPW >= 4:
                v2 = lane_value(w, 2, BITS, DECODE, table_ptr, tb, one_bits, ASM)
                v3 = lane_value(w, 3, BITS, DECODE, table_ptr, tb, one_bits, ASM)
            else:
                v2 = v0
                v3 = v0
        if DECODE == 2:
            pass
        elif CPW == 8:
            v4 = lane_value(w, 4, BITS, DECODE, table_ptr, tb, one_bits, ASM)
            v5 = lane_value(w, 5, BITS, DECODE, table_ptr, tb, one_bits, ASM)
            v6 = lane_value(w, 6, BITS, DECODE, table_ptr, tb, one_bits, ASM)
            v7 = lane_value(w, 7, BITS, DECODE, table_ptr, tb, one_bits, ASM)
        else:
            v4 = v0
            v5 = v0
            v6 = v0
            v7 = v0
        if HAS_OFFS:
            o = tl.load(offs_ptr + ((wi * CPW) // B)[:, None] + orow_off[None, :], mask=m2,
                        other=0).to(tl.float32)
        xoff = (wi * CPW)[:, None] + lane[None, :]  # [G, CPW] activation columns
        kmask = xoff < K
        p, xs = _row_dot(v0, v1, v2, v3, v4, v5, v6, v7, x_ptr + xrow * stride_xm, xoff,
                         kmask & (m0 < M), rb, K, CPW, HAS_AB, ACT, SWIGLU, LIMIT, ALPHA)
        acc0 += p * s
        if HAS_OFFS:
            aco0 += xs[:, None] * o
        if BM > 1:
            p, xs = _row_dot(v0, v1, v2, v3, v4, v5, v6, v7, x_ptr + (xrow + 1) * stride_xm,
                             xoff, kmask & (m0 + 1 < M), rb, K, CPW, HAS_AB, ACT,
                             SWIGLU, LIMIT, ALPHA)
            acc1 += p * s
            if HAS_OFFS:
                aco1 += xs[:, None] * o
        if BM > 2:
            p, xs = _row_dot(v0, v1, v2, v3, v4, v5, v6, v7, x_ptr + (xrow + 2) * stride_xm,
                             xoff, kmask & (m0 + 2 < M), rb, K, CPW, HAS_AB, ACT,
                             SWIGLU, LIMIT, ALPHA)
            acc2 += p * s
            if HAS_OFFS:
                aco2 += xs[:, None] * o
            p, xs = _row_dot(v0, v1, v2, v3, v4, v5, v6, v7, x_ptr + (xrow + 3) * stride_xm,
                             xoff, kmask & (m0 + 3 < M), rb, K, CPW, HAS_AB, ACT,
                             SWIGLU, LIMIT, ALPHA)
            acc3 += p * s
            if HAS_OFFS:
                aco3 += xs[:, None] * o
        if PREFETCH:
            wi = wi_n
            m2 = m2_n  # the offsets load above reads with this tile's mask
            w = w_n
            s = s_n
        else:
            wi = wi + G
            m2 = (wi < KW)[:, None] & rmask[None, :]
            w = _load_words(codes_ptr, row_off, wi, m2, BITS)
            s = _word_scales(scales_ptr, wi, srow_off, m2, CPW, B, SCALE_KIND, DECODE)
    # [BN, BM]: column i is activation row m0 + i
    if BM == 1:
        y = tl.sum(acc0, 0)[:, None]
    elif BM == 2:
        y = tl.join(tl.sum(acc0, 0), tl.sum(acc1, 0))
    else:
        y = tl.reshape(tl.join(tl.join(tl.sum(acc0, 0), tl.sum(acc2, 0)),
                               tl.join(tl.sum(acc1, 0), tl.sum(acc3, 0))), (BN, 4))
    y = y * (alpha * g)[:, None]
    if HAS_OFFS:
        if BM == 1:
            y += tl.sum(aco0, 0)[:, None]
        elif BM == 2:
            y += tl.join(tl.sum(aco0, 0), tl.sum(aco1, 0))
        else:
            y += tl.reshape(tl.join(tl.join(tl.sum(aco0, 0), tl.sum(aco2, 0)),
                                    tl.join(tl.sum(aco1, 0), tl.sum(aco3, 0))), (BN, 4))
    if MOE == 2:
        y = y * slot_w  # the bias gets it in _bias_col
    ms = m0 + tl.arange(0, BM)
    ymask = rmask[:, None] & (ms < M)[None, :]
    yoff = ms[None, :] * stride_ym + rows[:, None]
    if not SPLIT and not COMBINE:
        if HAS_BIAS:
            y += _bias_col(bias_ptr, e, rows, rmask, N, tw_ptr, pid_m, MOE)
        tl.store(y_ptr + yoff, y.to(y_ptr.dtype.element_ty), mask=ymask)
    elif COMBINE:  # MOE 2: the token's A slots x SPLIT_K partials meet in the workspace
        tok = pid_m // AT
        tile = tok * tl.num_programs(0) + pid_n
        arrived = _publish(ws_ptr, ms[None, :] * N + rows[:, None], y, ymask, pid_k, M * N,
                           sem_ptr, tile)
        if arrived == SPLIT_K * AT - 1:  # the last one sums slot by slot, splits in order
            tot = tl.zeros([BN, 1], tl.float32)
            for slot in range(AT):
                sj = tok * AT + slot
                sl = _sum_splits(ws_ptr, sj * N + rows[:, None], rmask[:, None], M * N, SPLIT_K,
                                 tl.zeros([BN, 1], tl.float32))
                if HAS_BIAS:
                    ej = tl.load(ids_ptr + sj).to(tl.int64)
                    sl += _bias_col(bias_ptr, ej, rows, rmask, N, tw_ptr, sj, MOE)
                tot += sl
            tl.store(y_ptr + tok * stride_ym + rows[:, None], tot.to(y_ptr.dtype.element_ty),
                     mask=rmask[:, None])
            tl.atomic_xchg(sem_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        part = ms[None, :] * N + rows[:, None]
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = _publish(ws_ptr, part, y, ymask, pid_k, M * N, sem_ptr, tile)
        if arrived == SPLIT_K - 1:
            tot = _sum_splits(ws_ptr, part, ymask, M * N, SPLIT_K, tl.zeros([BN, BM], tl.float32))
            if HAS_BIAS:
                tot += _bias_col(bias_ptr, e, rows, rmask, N, tw_ptr, pid_m, MOE)
            tl.store(y_ptr + yoff, tot.to(y_ptr.dtype.element_ty), mask=ymask)
            tl.atomic_xchg(sem_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _gemm_kernel(
    x_ptr, y_ptr, bias_ptr, ws_ptr, sem_ptr,
    codes_ptr, table_ptr, tidx_ptr, ab_ptr, scales_ptr, offs_ptr,
    M, N, K, KC, k_split, stride_xm, stride_ym, stride_cn, stride_sn, stride_on, g, SPLIT_K,
    BITS: tl.constexpr, DECODE: tl.constexpr, SCALE_KIND: tl.constexpr, B: tl.constexpr,
    SROWS: tl.constexpr, HAS_TIDX: tl.constexpr, HAS_AB: tl.constexpr, HAS_OFFS: tl.constexpr,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_F32: tl.constexpr, SPLIT: tl.constexpr,
    E2M1_BF16: tl.constexpr, ASM: tl.constexpr,
):
    # program axis 1 is a K split: columns pid_k * k_split .. + k_split (k_split % BK == 0);
    # SPLIT: partials through the workspace and the last-arriving split sums them (as the gemv)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
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
    row_off = rows.to(tl.int64) * stride_cn
    srow_off = (rows // SROWS).to(tl.int64) * stride_sn
    orow_off = rows.to(tl.int64) * stride_on
    t, alpha, beta = row_tables(tidx_ptr, ab_ptr, rows, rmask, BN, HAS_TIDX, HAS_AB)
    acc = tl.zeros([BM, BN], tl.float32)
    k_start = pid_k * k_split
    k_end = tl.minimum(k_start + k_split, K)
    for k0 in range(k_start, k_end, BK):
        kk = k0 + tl.arange(0, BK)
        xt = tl.load(x_ptr + ms.to(tl.int64)[:, None] * stride_xm + kk[None, :],
                     mask=mmask[:, None] & (kk < K)[None, :], other=0)
        w = dot_tile(codes_ptr, table_ptr, scales_ptr, offs_ptr, row_off, t * (1 << BITS),
                     alpha, beta, srow_off, orow_off, rmask, k0, KC, g, BN, BK, BITS, DECODE,
                     SCALE_KIND, B, HAS_AB, HAS_OFFS, E2M1_BF16, ASM)
        wt = tl.trans(w.to(xt.dtype))  # [BK, BN]
        if DOT_F32:  # the interpreter's bf16 dot is wrong; same rounding, fp32 product
            acc = tl.dot(xt.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, wt, acc)
    acc = dot_tile_post(acc, alpha, g, E2M1_BF16)
    ymask = mmask[:, None] & rmask[None, :]
    yoff = ms.to(tl.int64)[:, None] * stride_ym + rows[None, :]
    if not SPLIT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=rmask, other=0).to(tl.float32)[None, :]
        tl.store(y_ptr + yoff, acc.to(y_ptr.dtype.element_ty), mask=ymask)
    else:
        part = ms.to(tl.int64)[:, None] * N + rows[None, :]
        arrived = _publish(ws_ptr, part, acc, ymask, pid_k, M * N, sem_ptr, pid)
        if arrived == SPLIT_K - 1:
            tot = _sum_splits(ws_ptr, part, ymask, M * N, SPLIT_K, tl.zeros([BM, BN], tl.float32))
            if HAS_BIAS:
                tot += tl.load(bias_ptr + rows, mask=rmask, other=0).to(tl.float32)[None, :]
            tl.store(y_ptr + yoff, tot.to(y_ptr.dtype.element_ty), mask=ymask)
            tl.atomic_xchg(sem_ptr + pid, 0, sem="relaxed", scope="gpu")


def fmt_key(w: LutWeight | Fp8View) -> str:
    """The format part of a launch-config key: what changes the kernel's code (bits, decode
    mode, scale kind, block), so that formats that compile differently tune apart, e.g.
    nvfp4 -> "lut4-e2m1-e4m3-16", int4 g128 -> "lut4-affine-f16-128+offs", fp8 -> "fp8"."""
    if isinstance(w, Fp8View):
        return "fp8"
    v = w.view
    return (f"lut{v.bits}-{DECODE_NAMES[w.decode]}-{v.scale_kind}-{v.block_size}"
            + ("+offs" if v.offsets is not None else ""))


def _out(out: torch.Tensor | None, m: int, n: int, x: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.dtype in (x.dtype, torch.float32) and out.stride(1) == 1
    return out


def _check(x: torch.Tensor, w: LutWeight | Fp8View, bias: torch.Tensor | None) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, "x is [M, K], rows contiguous"
    assert x.dtype in ACT_DTYPES, f"activations are bf16 / fp16 / fp32, got {x.dtype}"
    assert w.lead == (), "a linear weight is [N, K]"
    assert x.shape[1] <= w.kp, "x has more columns than the weight"
    assert bias is None or (bias.shape == (w.n,) and bias.is_contiguous()
                            and bias.dtype in ACT_DTYPES and bias.device == x.device)
    codes = w.view.codes if isinstance(w, LutWeight) else w.codes
    assert codes.device == x.device, "weights and activations on one device"
    assert codes.dtype == (torch.uint8 if isinstance(w, LutWeight) else torch.float8_e4m3fn)


def _gemv_codes(w: LutWeight | Fp8View | DenseWeight) -> tuple[torch.Tensor, int, int]:
    """The codes as the gemv reads them: (tensor, row stride, words per row).

    4-bit and fp8: int32 words (8 or 4 codes each); 3-bit: bytes, read as 24-bit groups;
    dense bf16: int32 words of two weights.
    """
    if isinstance(w, DenseWeight):
        words = w.w.view(torch.int32)
        return words, words.stride(-2), words.shape[-1]
    codes = w.view.codes if isinstance(w, LutWeight) else w.codes
    bits = w.view.bits if isinstance(w, LutWeight) else 8
    if bits == 3:
        return codes, codes.stride(-2), codes.shape[-1] // 3
    as_bytes = codes.view(torch.uint8)
    words = as_bytes.view(torch.int32)
    return words, words.stride(-2), words.shape[-1]


def split_plan(cfg: dict, kw: int, tiles: int) -> tuple[int, int]:
    """(splits, words per split) along K. SPLIT_K = 0 in a config: enough splits for about
    four programs per SM, at most 8, and at most one split per tile of words."""
    g_words = cfg["G"]
    split = cfg.get("SPLIT_K", 0)
    if split == 0:
        split = min(8, max(1, round(4 * sm_count() / max(tiles, 1))))
    split = max(1, min(split, triton.cdiv(kw, g_words)))
    w_split = triton.cdiv(triton.cdiv(kw, split), g_words) * g_words
    return triton.cdiv(kw, w_split), w_split


def gemm_split_plan(cfg: dict, k: int, tiles: int) -> tuple[int, int]:
    """(splits, columns per split) along K for the tensor-core gemm. SPLIT_K = 0 (the
    default): enough splits for about two programs per SM when the output tiles alone leave
    SMs idle (decode-sized M), at most 16 and at least 4 BK steps per split."""
    bk = cfg["BK"]
    split = cfg.get("SPLIT_K", 0)
    steps = triton.cdiv(k, bk)
    if split == 0:
        split = min(16, (2 * sm_count()) // max(tiles, 1), steps // 4)
    split = max(1, min(split, steps))
    k_split = triton.cdiv(steps, split) * bk
    return triton.cdiv(k, k_split), k_split


def gemv_refusal(x: torch.Tensor, w: LutWeight | Fp8View | DenseWeight) -> str | None:
    """Why the gemv (lut_gemv, the MoE per-slot gemv) cannot take this call, or None."""
    if isinstance(w, DenseWeight):
        t = w.w
        if t.dtype != torch.bfloat16:
            return f"the gemv reads dense weights in bf16, got {t.dtype}"
        if t.shape[-1] % 2 or t.stride(-2) % 2 or t.storage_offset() % 2 or t.stride(-1) != 1:
            return "dense rows are not whole 32-bit words (two bf16 weights)"
        return f"gemv takes M <= 16 activation rows, got {x.shape[0]}" if x.shape[0] > 16 else None
    codes = w.view.codes if isinstance(w, LutWeight) else w.codes
    bits = w.view.bits if isinstance(w, LutWeight) else 8
    if x.shape[0] > 16:
        return f"gemv takes M <= 16 activation rows, got {x.shape[0]}"
    if bits != 3 and (codes.shape[-1] % 4 or codes.stride(-2) % 4 or codes.storage_offset() % 4):
        return "codes rows are not whole 32-bit words"
    return None


def lut_gemv(x: torch.Tensor, w: LutWeight | Fp8View, bias: torch.Tensor | None = None,
             config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] in x.dtype for M <= 16 (CUDA-core schedule, see module docstring)."""
    _check(x, w, bias)
    m, k = x.shape
    n = w.n
    assert gemv_refusal(x, w) is None, gemv_refusal(x, w)
    a = weight_args(w)
    codes, stride_cw, kw = _gemv_codes(w)
    cfg = config or launch.lookup("gemv", fmt_key(w), n, k, m)
    bm = 1 if m == 1 else (2 if m == 2 else 4)
    grid_m = triton.cdiv(m, bm)
    bn = min(cfg["BN"], 16) if a.has_offs else cfg["BN"]  # offsets double the accumulators
    grid_n = triton.cdiv(n, bn)
    split, w_split = split_plan(cfg, kw, grid_n * grid_m)
    y = _out(out, m, n, x)
    ws = torch.empty(split if split > 1 else 1, m, n, dtype=torch.float32, device=x.device)
    sem = semaphore(x.device, grid_n * grid_m)
    launch.run(_gemv_kernel, (grid_n, split, grid_m),
        x, y, x if bias is None else bias, ws, sem,
        codes, a.table, a.tidx, a.ab, a.scales, a.offs,
        m, n, k, kw, w_split, x.stride(0), y.stride(0), stride_cw, a.stride_sn, a.stride_on,
        a.g, 0x3F800000, x, x, 1, 0, 0, 0, 0, split, x, 0, 0, 0, 0,
        BITS=a.bits, DECODE=a.decode, SCALE_KIND=a.scale_kind, B=a.block,
        SROWS=a.srows, HAS_TIDX=a.has_tidx, HAS_AB=a.has_ab, HAS_OFFS=a.has_offs,
        HAS_BIAS=bias is not None, BM=bm, BN=bn, G=cfg["G"], SPLIT=split > 1,
        ASM=not interpreting(), PREFETCH=cfg.get("PREFETCH", True), MOE=0,
        SWIGLU=False, LIMIT=0.0, ALPHA=0.0, COMBINE=False, ORDER=False, NSH=0,
        num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 1),
    )
    return y


def lut_gemm(x: torch.Tensor, w: LutWeight | Fp8View, bias: torch.Tensor | None = None,
             config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] in x.dtype (bf16 / fp16 activations), tensor-core tiles."""
    _check(x, w, bias)
    assert x.dtype in (torch.bfloat16, torch.float16), "tl.dot reads bf16 / fp16 activations"
    m, k = x.shape
    n = w.n
    a = weight_args(w)
    cfg = config or launch.lookup("gemm", fmt_key(w), n, k, m)
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    y = _out(out, m, n, x)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split, k_split = gemm_split_plan(cfg, k, tiles)
    ws = torch.empty(split if split > 1 else 1, m, n, dtype=torch.float32, device=x.device)
    sem = semaphore(x.device, tiles)
    launch.run(_gemm_kernel, (tiles, split),
        x, y, x if bias is None else bias, ws, sem,
        a.codes, a.table, a.tidx, a.ab, a.scales, a.offs,
        m, n, k, a.kc, k_split, x.stride(0), y.stride(0), a.stride_cn, a.stride_sn, a.stride_on,
        a.g, split,
        BITS=a.bits, DECODE=a.decode, SCALE_KIND=a.scale_kind, B=a.block, SROWS=a.srows,
        HAS_TIDX=a.has_tidx, HAS_AB=a.has_ab, HAS_OFFS=a.has_offs, HAS_BIAS=bias is not None,
        BM=bm, BN=bn, BK=bk, GROUP_M=cfg.get("GROUP_M", 8), DOT_F32=interpreting(),
        SPLIT=split > 1, E2M1_BF16=cfg.get("E2M1_BF16", True) and e2m1_bf16(a),
        ASM=not interpreting(),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
    )
    return y


def reference_linear(x: torch.Tensor, w: LutWeight | Fp8View | DenseWeight,
                     bias: torch.Tensor | None = None,
                     dot_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch twin: decode with the format's reference, matmul in float32, cast to x.dtype.
    dot_dtype=torch.bfloat16 rounds the decoded weights as lut_gemm does before tl.dot (not
    when its tiles are exact: decode.exact_tiles)."""
    dense = w.dense(x.shape[-1])  # [N, K] float32
    if dot_dtype is not None and not exact_tiles(w):
        dense = round_for_dot(dense, dot_dtype)
    y = x.float() @ dense.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def gemv_waves(n: int, bn: int) -> float:
    """Programs per SM of a gemv without split-K (the tuner's first guess for SPLIT_K)."""
    return triton.cdiv(n, bn) / sm_count()
