"""Tensor-core GEMV for nvfp4 weights, M <= 16: y[M, N] = x[M, K] @ W^T (+ bias).

Shape legend: M activation rows (1..16), N output features, K input features (K % 128 == 0),
BN weight rows per program, BK codes per K step, MB the MMA's N (8 or 16: M padded).

The weight is the MMA's A operand and the activations its B operand ("swap AB"): an
mma.m16n8k16 multiplies 16 weight rows by 8 activation rows, so M = 1..8 cost one pass over
the weights and the tensor cores do the FMAs that the CUDA-core gemv (dequant_gemm.py) does
one by one. Written in Gluon (triton.experimental.gluon) because the layouts are the point:
- Codes are loaded 16 bytes a thread (LDG.128): thread (row g, lane tig) reads bytes
  16 tig .. 16 tig + 15 of each 64-byte group of its rows g, g + 8.
- The MMA's A layout (DotOperandLayout, k_width 8) holds 8 consecutive K positions a thread
  per 32: positions 32 c + 8 tig + i. The dot product does not care which real k a position
  stands for as long as x uses the same map, so position (c, tig, i) is made to stand for the
  real code 32 tig + 8 c + code(i): the decoded codes then sit in A's registers as loaded, and
  reshape / permute carry the map with no data movement (no shared memory, no shuffles). x
  is loaded 32 contiguous k a thread (four LDG.128) and permuted the same way.
- Decode: four bf16x2 from a code word with 15 integer instructions (the sign to bit 15, the
  magnitude e1 e0 m to bits 8..6: e2m1 * 2**-126, as decode.e2m1_tile_bf16), then one HMUL2
  by the e4m3 block scale * 2**118 (exact: a 2-bit by 4-bit significand product). The
  per-row alpha * g * 2**-6 multiplies the float32 accumulator once (decode.E2M1_BF16_POST).
- Split-K when N / BN programs cannot fill the SMs, deterministic as in dequant_gemm: each
  split writes its partial to a workspace, the last to arrive sums them in split order.
- PREFETCH 1 (2): the next K step's (next two steps') loads are in flight while this one is
  decoded. RING r (r >= 2, off by default): the loads go by cp.async into a shared-memory
  ring of r steps instead (`_mainloop_ring`), r - 1 steps in flight without registers;
  admitted where the ring's shared memory fits the device (`admitted_ring`), LOWBIT_TC_RING=0
  turns it off. LOWBIT_TC_NARROW=1 / 2 (`narrowed`, an A/B switch): launches of up to 8 rows
  run programs of one warp and 16 rows instead of their tuned configs. No load is masked:
  rows past N and activation rows past M read the last valid row, and their products land
  in accumulator rows / columns that are never stored (K is whole 128-code groups).
The kernel's MOE modes (per-slot expert FC1 / FC2) and the K loop (`_mainloop`) also serve
lowbit.kernels.tc_moe. Configs: "tc_gemv" in lowbit/kernels/configs/<device>.json
(scripts/tune_tc_gemv.py).
Reference twin: dequant_gemm.reference_linear (exact tiles: no weight rounding).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from lowbit.formats.views import LutWeight
from lowbit.kernels import launch
from lowbit.kernels.decode import E2M1_BF16_POST, e2m1_bf16, weight_args
from lowbit.kernels.runtime import HAS_TRITON, capability, semaphore, sm_count

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    HAS_GLUON = HAS_TRITON
except ImportError:  # no triton, or a triton without Gluon
    HAS_GLUON = False

BK_UNIT = 128  # K must be a multiple of this (one 64-byte code group a row)
MAX_M = 16

# Four code bytes (8 E2M1 codes n0..n7, code i at bits 4i..4i+3) -> four bf16x2: q << 4j puts
# codes (3 - j, 7 - j) in the top nibble of each 16-bit half; the sign stays at bit 15 and
# the magnitude moves from bits 14..12 to 8..6. Outputs: $0 = (n0, n4), $1 = (n1, n5),
# $2 = (n2, n6), $3 = (n3, n7).
_HALF = "and.b32 s, {q}, 0x80008000;\nand.b32 t, {q}, 0x70007000;\nshr.b32 t, t, 6;\nor.b32 {d}, s, t;\n"
_E2M1_PTX = ("{\n.reg .b32 q1, q2, q3, s, t;\nshl.b32 q1, $4, 4;\nshl.b32 q2, $4, 8;\nshl.b32 q3, $4, 12;\n"
             + _HALF.format(q="q3", d="$0") + _HALF.format(q="q2", d="$1")
             + _HALF.format(q="q1", d="$2") + _HALF.format(q="$4", d="$3") + "}")
_E2M1_CONSTRAINTS = "=r,=r,=r,=r," + ",".join(["r"] * 8)  # the word, 8 times (pack 8)


if HAS_GLUON:
    _E2M1_PTX_C = gl.constexpr(_E2M1_PTX)
    _E2M1_CONSTRAINTS_C = gl.constexpr(_E2M1_CONSTRAINTS)
    _SCALE_2_118 = gl.constexpr(2.0**118)

    @gluon.constexpr_function
    def _mma_layout(W):
        """mma.sync m16n8k16 accumulators, W warps stacked along the weight rows."""
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])

    @gluon.constexpr_function
    def _code_layout(BN, BKW, W):
        """Real code words [BN, BKW] (int32, 8 codes each): a thread holds 4 contiguous words
        (16 bytes) of a 16-word group for rows g and g + 8 (and the row / group repeats in
        registers)."""
        reg = [[0, 1], [0, 2], [8, 0]]
        reg += [[0, 16 << i] for i in range((BKW // 16).bit_length() - 1)]
        reg += [[16 * W << i, 0] for i in range((BN // (16 * W)).bit_length() - 1)]
        lane = [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]]
        warp = [[16 << i, 0] for i in range(W.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [BN, BKW])

    @gluon.constexpr_function
    def _scale_layout(BN, BKS, W):
        """Real e4m3 scale bytes [BN, BKS]: the two blocks of a thread's 32 codes."""
        reg = [[0, 1], [8, 0]]
        reg += [[0, 8 << i] for i in range((BKS // 8).bit_length() - 1)]
        reg += [[16 * W << i, 0] for i in range((BN // (16 * W)).bit_length() - 1)]
        lane = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
        warp = [[16 << i, 0] for i in range(W.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [BN, BKS])

    @gluon.constexpr_function
    def _scale_copy_layout(BN, BKS, W):
        """Scale bytes [BN, BKS] four to a thread, for cp.async (which copies 4, 8 or 16
        bytes; _scale_layout gives a thread 2 contiguous bytes)."""
        t1 = min(32, BKS // 4)
        return gl.BlockedLayout([1, 4], [32 // t1, t1], [W, 1], [1, 0])

    @gluon.constexpr_function
    def _scale_ptr_layout(BN, BKS, W, RING):
        """The layout of the scale pointers: the copy layout when they go through the ring."""
        return _scale_copy_layout(BN, BKS, W) if RING else _scale_layout(BN, BKS, W)

    @gluon.constexpr_function
    def _x_layout(BK, MB, W):
        """Real x^T [BK, MB]: a thread holds 32 contiguous k of activation row lane // 4
        (replicated over the warps)."""
        reg = [[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]]
        reg += [[128 << i, 0] for i in range((BK // 128).bit_length() - 1)]
        reg += [[0, 8 << i] for i in range((MB // 8).bit_length() - 1)]
        lane = [[32, 0], [64, 0], [0, 1], [0, 2], [0, 4]]
        warp = [[0, 0] for i in range(W.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [BK, MB])

    @gluon.jit
    def _silu_mul(gate, up):
        """SiLU(gate) * up in float32, exp(-|g|)-based (no overflow for large |g|)."""
        ez = gl.exp(-gl.abs(gate))
        return gate * gl.where(gate >= 0, 1.0 / (1.0 + ez), ez / (1.0 + ez)) * up

    @gluon.jit
    def _pdl_enter(PDL: gl.constexpr):
        """lowbit.kernels.pdl.pdl_enter for Gluon kernels: wait for the kernels before this
        one, then let the next one launch (the protocol in lowbit.kernels.launch)."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                      dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _tile_loads(cptr, sptr, xptr, hrow, kc, K, BK: gl.constexpr, MOE: gl.constexpr,
                    L1: gl.constexpr):
        """One K step's code bytes, scale bytes and activations: x^T [BK, MB] (MOE 0, 1), or
        FC1's gate and up halves of the slot's row (MOE 2; the last value is a placeholder
        otherwise)."""
        codes = gl.load(cptr + gl.multiple_of(kc // 8, BK // 8))
        sc = gl.load(sptr + gl.multiple_of(kc // 16, BK // 16))
        xa, xb = _x_loads(xptr, hrow, kc, K, BK, MOE, L1)
        return codes, sc, xa, xb

    @gluon.jit
    def _x_loads(xptr, hrow, kc, K, BK: gl.constexpr, MOE: gl.constexpr, L1: gl.constexpr):
        if MOE == 2:
            hk = hrow + kc + gl.arange(0, BK, layout=L1)
            xa = gl.load(hk)
            xb = gl.load(hk + K)
        else:
            xa = gl.load(xptr + kc)
            xb = kc
        return xa, xb

    @gluon.jit
    def _mma_step(acc, codes, sc, xa, xb, BN: gl.constexpr, BK: gl.constexpr, MB: gl.constexpr,
                  W: gl.constexpr, MOE: gl.constexpr):
        """acc + one K step: the step's code words (LC), scale bytes (LS) and activations (x^T
        in LX; MOE 2: FC1's gate and up halves in a 1-D layout) decoded and multiplied."""
        mma: gl.constexpr = _mma_layout(W)
        LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
        LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        LX: gl.constexpr = _x_layout(BK, MB, W)
        G: gl.constexpr = BK // 128
        if MOE == 2:  # the activation once per k (not per thread of LX), then broadcast
            v = _silu_mul(xa.to(gl.float32), xb.to(gl.float32))
            v = gl.convert_layout(v.to(gl.bfloat16), gl.SliceLayout(1, LX))
            xv = gl.broadcast(v[:, None], gl.full([BK, MB], 0.0, gl.bfloat16, layout=LX))[0]
        else:
            xv = xa
        # word wr = 16 G + 4 tig + c; element e of its 8 decoded values is code
        # 4 (e % 2) + e // 2 (the PTX's output order); the scale of a word is that of
        # block wr // 2
        w8 = gl.join(codes, codes)
        w8 = gl.join(w8, w8)
        w8 = gl.join(w8, w8)  # [BN, BK/8, 2, 2, 2]: the word 8 times (pack 8: one asm a word)
        w = gl.inline_asm_elementwise(_E2M1_PTX_C, _E2M1_CONSTRAINTS_C, [w8],
                                      dtype=gl.bfloat16, is_pure=True, pack=8)
        s = (sc.to(gl.float8e4nv, bitcast=True).to(gl.float32) * _SCALE_2_118).to(gl.bfloat16)
        s = gl.reshape(gl.join(s, s), [BN, BK // 8])
        s = gl.join(s, s)
        s = gl.join(s, s)
        s = gl.join(s, s)  # [BN, BK/8, 2, 2, 2]
        w = w * gl.convert_layout(s, w.type.layout)
        # (G, tig, c, e2, e1, e0) -> position 128 G + 32 c + 8 tig + 4 e2 + 2 e1 + e0
        w = gl.reshape(w, [BN, G, 4, 4, 2, 2, 2])
        w = gl.permute(w, [0, 1, 3, 2, 4, 5, 6])
        a = gl.convert_layout(gl.reshape(w, [BN, BK]), LA)
        # x: real k = 128 G + 32 tig + 8 c + 4 e0 + 2 e2 + e1, to the same positions
        xv = gl.reshape(xv, [G, 4, 4, 2, 2, 2, MB])
        xv = gl.permute(xv, [0, 2, 1, 4, 5, 3, 6])
        b = gl.convert_layout(gl.reshape(xv, [BK, MB]), LB)
        return mma_v2(a, b, acc)

    @gluon.jit
    def _mainloop(cptr, sptr, xptr, hrow, k0, k1, K, BN: gl.constexpr, BK: gl.constexpr,
                  MB: gl.constexpr, W: gl.constexpr, MOE: gl.constexpr, PREFETCH: gl.constexpr,
                  PDL: gl.constexpr):
        """acc [BN, MB] float32 (mma layout) = the decoded weight rows at cptr / sptr times the
        activations at xptr (MOE 2: SiLU(gate) * up of the row at hrow) over k0 <= k < k1.
        PREFETCH 0: each K step loads after the one before is decoded; 1: the next step's loads
        are in flight while this one is decoded; 2: the next two steps' loads.
        PDL: the codes and scales of the first K step (PREFETCH 2: the first two) are loaded
        before the wait for the kernel that writes x, so they are in flight while that kernel
        finishes."""
        mma: gl.constexpr = _mma_layout(W)
        L1: gl.constexpr = gl.BlockedLayout([max(BK // (32 * W), 1)], [32], [W], [0])
        acc = gl.zeros([BN, MB], gl.float32, layout=mma)
        k0 = gl.multiple_of(k0, BK)
        # the step after k0 (k0 again when the range is one step: in bounds, unused)
        kn0 = gl.multiple_of(gl.minimum(k0 + BK, k1 - BK), BK)
        codes = gl.load(cptr + gl.multiple_of(k0 // 8, BK // 8))
        sc = gl.load(sptr + gl.multiple_of(k0 // 16, BK // 16))
        if PREFETCH == 2:
            codes_n = gl.load(cptr + gl.multiple_of(kn0 // 8, BK // 8))
            sc_n = gl.load(sptr + gl.multiple_of(kn0 // 16, BK // 16))
        _pdl_enter(PDL)
        xa, xb = _x_loads(xptr, hrow, k0, K, BK, MOE, L1)
        if PREFETCH == 2:
            xa_n, xb_n = _x_loads(xptr, hrow, kn0, K, BK, MOE, L1)
        for kk in range(k0, k1, BK):
            # the step PREFETCH ahead (the last one again at the end: in bounds, unused)
            kn = gl.multiple_of(gl.minimum(kk + PREFETCH * BK, k1 - BK), BK)
            if PREFETCH > 0:  # its loads are in flight while this tile is decoded
                codes_f, sc_f, xa_f, xb_f = _tile_loads(cptr, sptr, xptr, hrow, kn, K, BK, MOE, L1)
            acc = _mma_step(acc, codes, sc, xa, xb, BN, BK, MB, W, MOE)
            if PREFETCH == 2:
                codes, sc, xa, xb = codes_n, sc_n, xa_n, xb_n
                codes_n, sc_n, xa_n, xb_n = codes_f, sc_f, xa_f, xb_f
            elif PREFETCH == 1:
                codes, sc, xa, xb = codes_f, sc_f, xa_f, xb_f
            else:
                codes, sc, xa, xb = _tile_loads(cptr, sptr, xptr, hrow, kn, K, BK, MOE, L1)
        return acc

    @gluon.jit
    def _live(ptr, live):
        """A mask of ptr's shape and layout, everywhere `live` (a scalar)."""
        lay: gl.constexpr = ptr.type.layout
        return gl.zeros(ptr.shape, gl.int32, layout=lay) < live.to(gl.int32)

    @gluon.jit
    def _ring_copy_weights(c_s, s_s, cptr, sptr, kc, live, BK: gl.constexpr):
        """cp.async of one K step's code words and scale bytes into a ring slot (zero bytes
        read when not live: a step past the program's range)."""
        async_copy.async_copy_global_to_shared(c_s, cptr + gl.multiple_of(kc // 8, BK // 8),
                                               mask=_live(cptr, live))
        async_copy.async_copy_global_to_shared(s_s, sptr + gl.multiple_of(kc // 16, BK // 16),
                                               mask=_live(sptr, live))

    @gluon.jit
    def _ring_copy_x(xa_s, xb_s, xptr, hrow, kc, K, live, BK: gl.constexpr, MOE: gl.constexpr,
                     L1: gl.constexpr):
        """cp.async of one K step's activations into a ring slot: x^T [BK, MB] into xa_s
        (MOE 0, 1), or FC1's gate and up halves [BK] into xa_s and xb_s (MOE 2)."""
        if MOE == 2:
            hk = hrow + kc + gl.arange(0, BK, layout=L1)
            async_copy.async_copy_global_to_shared(xa_s, hk, mask=_live(hk, live))
            async_copy.async_copy_global_to_shared(xb_s, hk + K, mask=_live(hk, live))
        else:
            async_copy.async_copy_global_to_shared(xa_s, xptr + kc, mask=_live(xptr, live))

    @gluon.jit
    def _mainloop_ring(cptr, sptr, xptr, hrow, k0, k1, K, BN: gl.constexpr, BK: gl.constexpr,
                       MB: gl.constexpr, W: gl.constexpr, MOE: gl.constexpr, RING: gl.constexpr,
                       PDL: gl.constexpr):
        """_mainloop with the loads in a shared-memory ring of RING K steps (cp.async): RING - 1
        steps' bytes are in flight while one is decoded, without holding registers. cptr is in
        the code layout (LC); sptr in a copy layout of 4 bytes a thread (_scale_copy_layout),
        read back in LS; x as in _mainloop. PDL: the first RING - 1 steps' codes and scales are
        requested before the wait, their activations after it. A step past the range (or every
        step of an empty range: the grouped kernel's tiles past the last) copies zero bytes
        from an address inside the range's first step.
        Every thread waits for its own copies (wait_group), then a barrier makes all of them
        visible; the barrier also orders the reads of the slot a step overwrites (read the
        step before) before that step's copies."""
        mma: gl.constexpr = _mma_layout(W)
        LC: gl.constexpr = _code_layout(BN, BK // 8, W)
        LS: gl.constexpr = _scale_layout(BN, BK // 16, W)
        LX: gl.constexpr = _x_layout(BK, MB, W)
        L1: gl.constexpr = gl.BlockedLayout([max(BK // (32 * W), 1)], [32], [W], [0])
        S3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        S2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        c_s = gl.allocate_shared_memory(gl.int32, [RING, BN, BK // 8], S3)
        s_s = gl.allocate_shared_memory(gl.uint8, [RING, BN, BK // 16], S3)
        if MOE == 2:  # FC1's float32 gate and up halves
            xa_s = gl.allocate_shared_memory(gl.float32, [RING, BK], S2)
            xb_s = gl.allocate_shared_memory(gl.float32, [RING, BK], S2)
        else:  # x^T, k contiguous
            xa_s = gl.allocate_shared_memory(xptr.dtype.element_ty, [RING, BK, MB],
                                             gl.SwizzledSharedLayout(1, 1, 1, [0, 1]))
            xb_s = xa_s
        acc = gl.zeros([BN, MB], gl.float32, layout=mma)
        k0 = gl.multiple_of(k0, BK)
        steps = (k1 - k0) // BK
        for i in gl.static_range(RING - 1):
            _ring_copy_weights(c_s.index(i), s_s.index(i), cptr, sptr,
                               k0 + gl.maximum(gl.minimum(i, steps - 1), 0) * BK, i < steps, BK)
            async_copy.commit_group()
        _pdl_enter(PDL)
        for i in gl.static_range(RING - 1):
            _ring_copy_x(xa_s.index(i), xb_s.index(i), xptr, hrow,
                         k0 + gl.maximum(gl.minimum(i, steps - 1), 0) * BK, K, i < steps, BK, MOE, L1)
            async_copy.commit_group()
        for j in range(0, steps):
            # groups committed after step j's: the prologue's later ones, or the RING - 2
            # steps issued since
            async_copy.wait_group(RING - 2)
            gl.thread_barrier()
            jn = j + RING - 1
            kn = k0 + gl.minimum(jn, steps - 1) * BK
            _ring_copy_weights(c_s.index(jn % RING), s_s.index(jn % RING), cptr, sptr, kn,
                               jn < steps, BK)
            _ring_copy_x(xa_s.index(jn % RING), xb_s.index(jn % RING), xptr, hrow, kn, K,
                         jn < steps, BK, MOE, L1)
            async_copy.commit_group()
            slot = j % RING
            codes = c_s.index(slot).load(LC)
            sc = s_s.index(slot).load(LS)
            if MOE == 2:
                xa = xa_s.index(slot).load(L1)
                xb = xb_s.index(slot).load(L1)
            else:
                xa = xa_s.index(slot).load(LX)
                xb = xa
            acc = _mma_step(acc, codes, sc, xa, xb, BN, BK, MB, W, MOE)
        async_copy.wait_group(0)
        return acc

    @gluon.jit
    def _tc_gemv_kernel(x_ptr, y_ptr, bias_ptr, ws_ptr, sem_ptr, codes_ptr, scales_ptr, ab_ptr,
                        M, N, K, stride_xm, stride_ym, stride_cn, stride_sn, gpost, k_split,
                        SPLIT_K, ids_ptr, tw_ptr, A, stride_ce, stride_se, tidx_ptr, stride_te,
                        HAS_TIDX: gl.constexpr, HAS_BIAS: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                        MB: gl.constexpr, W: gl.constexpr, SPLIT: gl.constexpr,
                        MOE: gl.constexpr, PREFETCH: gl.constexpr, PDL: gl.constexpr,
                        RING: gl.constexpr = 0):
        # MOE 0: y [M, N] = x [M, K] @ W^T. MOE 1 (expert FC1) / 2 (expert FC2): program axis 2
        # is a routed slot s of M = S; the weight is expert ids[s] of a stack, the activation
        # row x[s // A] (FC1) or SiLU(h[s, :K]) * h[s, K:] (FC2, h = FC1's float32 output);
        # FC1 writes y [S, N]; FC2 scales by the routing weight tw[s] and the program that
        # arrives last among a token's A slots x SPLIT_K splits writes y [T, N], the ordered
        # sum of its slots (no combine launch).
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        pid_m = gl.program_id(2)
        mma: gl.constexpr = _mma_layout(W)
        LC: gl.constexpr = _code_layout(BN, BK // 8, W)
        LS: gl.constexpr = _scale_ptr_layout(BN, BK // 16, W, RING)
        LX: gl.constexpr = _x_layout(BK, MB, W)

        if MOE == 1:  # the expert id is written by the router, the kernel before: wait
            _pdl_enter(PDL)
            e = gl.load(ids_ptr + pid_m).to(gl.int64)
        elif MOE == 2:
            # FC2 runs after FC1, which signals its dependents only after its own wait: when
            # FC2 starts, the router that wrote the ids has completed. Read them from L2 (.cg)
            # and fetch the expert's first weight tile before waiting for FC1's output.
            e = gl.load(ids_ptr + pid_m, cache_modifier=".cg").to(gl.int64)
        if RING:  # 4-byte cp.async of the scales (admitted_ring checked the host strides)
            stride_sn = stride_sn // 4 * 4
            stride_se = stride_se // 4 * 4
        if MOE > 0:
            codes_ptr += e * stride_ce
            scales_ptr += e * stride_se
            tidx_ptr += e * stride_te
        # rows past N read row N - 1 and x rows past M read row M - 1: valid memory whose
        # products land in accumulator rows / columns that are never stored (no load masks)
        rows = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LC)), N - 1)
        cb = gl.arange(0, BK // 8, layout=gl.SliceLayout(0, LC))
        cptr = codes_ptr + rows.to(gl.int64)[:, None] * stride_cn + cb[None, :]
        rows_s = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LS)), N - 1)
        sb = gl.arange(0, BK // 16, layout=gl.SliceLayout(0, LS))
        sptr = scales_ptr + rows_s.to(gl.int64)[:, None] * stride_sn + sb[None, :]
        kx = gl.arange(0, BK, layout=gl.SliceLayout(1, LX))
        if MOE == 0:
            nx = gl.minimum(gl.arange(0, MB, layout=gl.SliceLayout(0, LX)), M - 1)
        else:  # one activation row, in every column
            xrow = pid_m // A if MOE == 1 else pid_m
            nx = gl.zeros([MB], gl.int32, layout=gl.SliceLayout(0, LX)) + xrow
        xptr = x_ptr + nx.to(gl.int64)[None, :] * stride_xm + kx[:, None]
        hrow = x_ptr + pid_m.to(gl.int64) * stride_xm

        k0 = pid_k * k_split
        k1 = gl.minimum(k0 + k_split, K)
        if RING:
            acc = _mainloop_ring(cptr, sptr, xptr, hrow, k0, k1, K, BN, BK, MB, W, MOE, RING,
                                 PDL if MOE != 1 else False)
        else:
            acc = _mainloop(cptr, sptr, xptr, hrow, k0, k1, K, BN, BK, MB, W, MOE, PREFETCH,
                            PDL if MOE != 1 else False)
        ro = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        if HAS_TIDX:  # per-row code tables (merged projections): alpha of the row's table
            t = gl.load(tidx_ptr + gl.minimum(ro, N - 1))
            acc = acc * (gl.load(ab_ptr + 2 * t) * gpost)[:, None]
        else:
            acc = acc * (gl.load(ab_ptr) * gpost)
        if MOE == 2:
            acc = acc * gl.load(tw_ptr + pid_m)
        no = gl.arange(0, MB, layout=gl.SliceLayout(0, mma))
        if MOE == 0:
            ymask = (ro < N)[:, None] & (no < M)[None, :]
            mrow = no
            tile = pid_n
        else:  # column 0 only; row pid_m of the workspace / of y (FC1)
            ymask = (ro < N)[:, None] & (no < 1)[None, :]
            mrow = no + pid_m
            tile = pid_m * gl.num_programs(0) + pid_n
        part = mrow[None, :] * N + ro[:, None]
        yoff = mrow[None, :] * stride_ym + ro[:, None]
        if MOE == 2:
            tok = pid_m // A
            tile = tok * gl.num_programs(0) + pid_n
            gl.store(ws_ptr + pid_k * (M * N) + part, acc, mask=ymask)
            gl.thread_barrier()
            arrived = gl.atomic_add(sem_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K * A - 1:  # the last one sums slot by slot, splits in order
                tot = gl.zeros([BN, MB], gl.float32, layout=mma)
                for slot in range(A):
                    for sk in range(SPLIT_K):
                        tot += gl.load(ws_ptr + sk * (M * N) + (part + (tok * A + slot - pid_m) * N),
                                       mask=ymask, other=0.0, cache_modifier=".cg")
                gl.store(y_ptr + (yoff + (tok - pid_m) * stride_ym), tot.to(y_ptr.dtype.element_ty),
                         mask=ymask)
                gl.atomic_xchg(sem_ptr + tile, 0, sem="relaxed", scope="gpu")
        elif SPLIT:
            gl.store(ws_ptr + pid_k * (M * N) + part, acc, mask=ymask)
            gl.thread_barrier()
            arrived = gl.atomic_add(sem_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the last split sums all of them in split order
                tot = gl.zeros([BN, MB], gl.float32, layout=mma)
                for sk in range(SPLIT_K):
                    tot += gl.load(ws_ptr + sk * (M * N) + part, mask=ymask, other=0.0,
                                   cache_modifier=".cg")
                if HAS_BIAS:
                    tot += gl.load(bias_ptr + ro, mask=ro < N, other=0.0).to(gl.float32)[:, None]
                gl.store(y_ptr + yoff, tot.to(y_ptr.dtype.element_ty), mask=ymask)
                gl.atomic_xchg(sem_ptr + tile, 0, sem="relaxed", scope="gpu")
        else:
            if HAS_BIAS:
                acc += gl.load(bias_ptr + ro, mask=ro < N, other=0.0).to(gl.float32)[:, None]
            gl.store(y_ptr + yoff, acc.to(y_ptr.dtype.element_ty), mask=ymask)


def tc_gemv_refusal(x: torch.Tensor, w) -> str | None:
    """Why tc_gemv cannot take this call, or None (the call's shape and format first, then
    where it runs)."""
    return _shape_refusal(x, w) or _device_refusal(x)


def _shape_refusal(x: torch.Tensor, w) -> str | None:
    if not isinstance(w, LutWeight) or not e2m1_bf16(weight_args(w)):
        return "reads nvfp4 only (E2M1 codes, e4m3 scales of 16)"
    if x.dtype != torch.bfloat16:
        return f"activations are {x.dtype}, this kernel multiplies bf16"
    m, k = x.shape
    if m > MAX_M:
        return f"M = {m} > {MAX_M}"
    if k % BK_UNIT or w.kp != k:
        return f"K = {k} (weight stores {w.kp}): needs K = stored K, a multiple of {BK_UNIT}"
    codes = w.view.codes
    if codes.stride(-2) % 16 or codes.storage_offset() % 16 or x.stride(0) % 8:
        return "code rows or x rows are not 16-byte aligned"
    return None


def _device_refusal(x: torch.Tensor) -> str | None:
    if not HAS_GLUON:
        return "triton with Gluon (triton.experimental.gluon) is not installed"
    if not x.is_cuda:
        return f"tensors on {x.device.type} (a Gluon kernel, CUDA only)"
    if capability(x.device.index or 0) < (8, 9):
        return "needs compute capability 8.9+ (bf16 mma.sync, float8_e4m3 scales)"
    return None


DEFAULT = {"BN": 64, "BK": 256, "num_warps": 4, "WAVES": 4}
RING_SMEM_SLACK = 8 << 10  # shared memory the compiler may add to a RING kernel's own (layout conversions)
log = logging.getLogger("lowbit")


def ring_bytes(ring: int, bn: int, bk: int, mb: int, moe: int, x_size: int) -> int:
    """Shared memory of a RING config's ring: `ring` K steps of code words (BN x BK / 2 bytes),
    scale bytes (BN x BK / 16) and activations (x^T [BK, MB] of x_size bytes, or FC2's float32
    gate and up halves)."""
    x = 2 * bk * 4 if moe == 2 else bk * mb * x_size
    return ring * (bn * bk // 2 + bn * bk // 16 + x)


@functools.cache
def _smem_limit(index: int) -> int:
    """Shared memory a block may opt into on this device (227 KiB on sm_90)."""
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


@functools.cache
def _warn_ring(ring: int, why: str) -> None:
    log.warning("tc_gemv: config RING %d refused (%s); the K loop keeps its loads in registers", ring, why)


def ring_enabled() -> bool:
    """Whether configs that ask for the shared-memory ring get it: LOWBIT_TC_RING=0 runs every
    config's register loop instead (the A/B of a shipped ring config)."""
    return os.environ.get("LOWBIT_TC_RING", "1") != "0"


NARROW_ENV = "LOWBIT_TC_NARROW"  # an A/B switch read at every launch (bench latency --variant)
NARROW = {"BN": 16, "num_warps": 1, "WAVES": 2, "RING": 0}


def narrow_mode() -> int:
    """LOWBIT_TC_NARROW: 0 (unset) the configs as tuned; 1 programs of one warp and 16 rows
    (NARROW) for launches of up to 8 activation rows, so that the engine's C1 / C8 grids fill
    the SMs with few K splits or none; 2 the same with two K steps in flight (PREFETCH 2)."""
    mode = os.environ.get(NARROW_ENV, "0")
    if mode not in ("0", "1", "2"):
        raise ValueError(f"{NARROW_ENV}={mode!r}: expected 0, 1 or 2")
    return int(mode)


def narrowed(cfg: dict, rows: int) -> dict:
    """cfg as LOWBIT_TC_NARROW says for a launch of `rows` activation rows (a per-slot MoE
    launch: 1)."""
    mode = narrow_mode()
    if not mode or rows > 8:
        return cfg
    return dict(cfg, **NARROW, **({"PREFETCH": 2} if mode == 2 else {}))


def ring_configs(table: dict) -> int:
    """How many configs of a device file's "tc_gemv" / "tc_moe" tables ask for RING."""
    def count(node) -> int:
        if isinstance(node, dict):
            return int(bool(node.get("RING"))) + sum(count(v) for v in node.values())
        return 0
    return count(table.get("tc_gemv", {})) + count(table.get("tc_moe", {}))


def ring_scales_aligned(a) -> bool:
    """Whether a weight's scale rows (and expert stacks) start on 4 bytes from a 16-byte
    base, as the ring's 4-byte cp.async of the scales needs (weight_args' view `a`)."""
    return a.stride_sn % 4 == 0 and a.stride_se % 4 == 0 and a.scales.data_ptr() % 16 == 0


def admitted_ring(ring: int, bn: int, bk: int, mb: int, moe: int, x_size: int, limit: int,
                  aligned: bool = True) -> int:
    """The config's RING, or 0 (the register loop, PREFETCH) where it cannot run: fewer than
    two slots, scale rows that are not 4-byte aligned (`aligned`, ring_scales_aligned), or a
    ring whose shared memory (plus RING_SMEM_SLACK) passes `limit` bytes.
    A refusal is logged as a warning once per reason; LOWBIT_TC_RING=0 (ring_enabled) gives
    0 without one."""
    if not ring or not ring_enabled():
        return 0
    if ring < 2:
        _warn_ring(ring, "a ring needs at least 2 slots")
        return 0
    if not aligned:
        _warn_ring(ring, "scale rows are not 4-byte aligned (the ring copies scales 4 bytes at a time)")
        return 0
    need = ring_bytes(ring, bn, bk, mb, moe, x_size) + RING_SMEM_SLACK
    if need > limit:
        _warn_ring(ring, f"{need} bytes of shared memory at BN {bn}, BK {bk}, MB {mb} > the device's {limit}")
        return 0
    return ring


def split_for(n_tiles: int, k_steps: int, waves: int, sms: int) -> int:
    """K splits so that about `waves` programs per SM run, each with >= 2 K steps."""
    want = max(1, -(-waves * sms // n_tiles))
    return max(1, min(want, k_steps // 2 or 1))


def _plan(n: int, k: int, m: int, slots: int, cfg: dict, device) -> tuple[int, int, int, int, int]:
    """(BN, BK, MB, split, k_split) of one launch."""
    bn, bk = cfg["BN"], cfg["BK"]
    bk = bk if k % bk == 0 else BK_UNIT
    mb = 8 if m <= 8 else 16
    grid_n = -(-n // bn)
    steps = k // bk
    split = cfg.get("SPLIT") or split_for(grid_n * slots, steps, cfg["WAVES"],
                                          sm_count(device.index or 0))
    k_split = -(-steps // split) * bk
    return bn, bk, mb, -(-k // k_split), k_split


def _launch(x, y, bias, w, m, n, k, cfg, slots=1, moe=0, ids=None, tw=None, a_top=1):
    cfg = narrowed(cfg, 1 if moe else m)
    bn, bk, mb, split, k_split = _plan(n, k, 1 if moe else m, slots, cfg, x.device)
    grid_n = -(-n // bn)
    a = weight_args(w)
    parts = split if split > 1 or moe == 2 else 1
    ws = torch.empty(parts, m, n, dtype=torch.float32, device=x.device)
    sem = semaphore(x.device, grid_n * slots)
    ring = admitted_ring(int(cfg.get("RING", 0)), bn, bk, mb, moe, x.element_size(),
                         _smem_limit(x.device.index or 0), ring_scales_aligned(a))
    launch.run(_tc_gemv_kernel, (grid_n, split, slots),
               x, y, x if bias is None else bias, ws, sem, a.codes.view(torch.int32),
               a.scales.view(torch.uint8),
               a.ab, m, n, k, x.stride(0), y.stride(0), a.stride_cn // 4, a.stride_sn,
               a.g * E2M1_BF16_POST, k_split, split, x if ids is None else ids,
               x if tw is None else tw, a_top, a.stride_ce // 4, a.stride_se, a.tidx, a.stride_te,
               HAS_TIDX=a.has_tidx, HAS_BIAS=bias is not None, BN=bn, BK=bk, MB=mb, W=cfg["num_warps"],
               SPLIT=split > 1, MOE=moe, PREFETCH=int(cfg.get("PREFETCH", True)),
               RING=ring, num_warps=cfg["num_warps"], **launch.pdl_args(x))


def tc_gemv(x: torch.Tensor, w: LutWeight, bias: torch.Tensor | None = None,
            config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] in x.dtype, or into out (x.dtype or float32); M <= 16, nvfp4 weights [N, K]."""
    reason = tc_gemv_refusal(x, w)
    assert reason is None, reason
    assert w.lead == () and x.stride(1) == 1
    m, k = x.shape
    n = w.n
    cfg = dict(DEFAULT, **(config or launch.lookup("tc_gemv", "nvfp4", n, k, m)))
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert y.shape == (m, n) and y.stride(1) == 1
    _launch(x, y, bias, w, m, n, k, cfg)
    return y
