"""Tensor-core nvfp4 MoE: the expert layer on lowbit.kernels.tc_gemv's kernels.

Shape legend: T tokens, A experts per token (top-k), S = T * A slots, E experts, H hidden,
I expert width (w13 [E, 2I, H]: gate rows then up rows; w2 [E, H, I]).
Two schedules, both nvfp4 experts with SiLU and no biases, CUDA-graph safe (no host read):
  tc_moe_gemv     per slot: FC1 [S, 2I] float32, FC2 with SiLU(gate) * up made on load, times
                  the routing weight, each token's slots summed in order by FC2's
                  last-arriving program (tc_gemv's MOE modes; two launches). An expert used
                  by several tokens is read once per token.
  tc_moe_grouped  per expert: the slots sorted by expert on the device
                  (moe_slots.sort_by_expert, tiles of 8), a tile's slots as the MMA's B
                  columns so each expert is read once for up to 8 tokens; FC1 pairs gate row r
                  with up row r in one thread and writes bf16(SiLU(gate) * up) [S, I]; FC2
                  writes each slot's output times its routing weight [S, H]; combine_slots
                  sums a token's in order, skipping slots placed nowhere (five launches;
                  up to 1,024 slots the sort is one, and with defer the next RMSNorm sums
                  the slots (moe_slots.SlotSum): three; config FOLD, off: three, FC2 summing
                  each token's slots itself).
Reference twin: moe.reference_moe with dot_dtype=torch.bfloat16 (exact nvfp4 tiles: the
weights are not rounded; x and the activation are).
"""

from __future__ import annotations

import torch

from lowbit.formats.views import LutWeight
from lowbit.kernels import launch
from lowbit.kernels.decode import E2M1_BF16_POST, weight_args
from lowbit.kernels.moe_slots import (
    SlotSum,
    combine_slots,
    flat_slots,
    moe_output,
    slot_fusion,
    sort_by_expert,
    sort_for_fold,
)
from lowbit.kernels.runtime import semaphore
from lowbit.kernels.tc_gemv import (
    BK_UNIT,
    DEFAULT,
    HAS_GLUON,
    _device_refusal,
    _launch,
    _shape_refusal,
    _smem_limit,
    admitted_ring,
    ring_scales_aligned,
)

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from lowbit.kernels.tc_gemv import (
        _code_layout,
        _mainloop,
        _mainloop_ring,
        _mma_layout,
        _pdl_enter,
        _scale_ptr_layout,
        _silu_mul,
        _x_layout,
    )

    @gluon.jit
    def _slot_of(order_ptr, seg, j0, n, last, S):
        """Slot of column n of a tile: order[seg + min(j0 + n, last)], the position and the
        value kept inside 0..S-1. An empty tile (past the last one) or one of an expert with no
        slots would otherwise read past its segment: positions never written, whose values
        would address memory the loads and stores below must not touch."""
        pos = gl.minimum(seg + gl.minimum(j0 + n, last), S - 1)
        return gl.minimum(gl.maximum(gl.load(order_ptr + pos), 0), S - 1)

    @gluon.jit
    def _tc_moe_grouped_kernel(x_ptr, y_ptr, codes_ptr, scales_ptr, ab_ptr, tidx_ptr, tw_ptr,
                               order_ptr, tile_end_ptr, seg_start_ptr, counts_ptr,
                               ids_ptr, need_ptr, out_ptr, sem_ptr, stride_out,
                               N, K, E, A, S, stride_xm, stride_ym, stride_cn, stride_sn,
                               stride_ce, stride_se, stride_te, gpost, EP: gl.constexpr,
                               HAS_TIDX: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                               MB: gl.constexpr, W: gl.constexpr, FC: gl.constexpr,
                               PREFETCH: gl.constexpr, FOLD: gl.constexpr, PDL: gl.constexpr,
                               RING: gl.constexpr = 0):
        # Program (pid_n, p): tile p of the slots sorted by expert (moe_slots.sort_by_expert,
        # tiles of MB slots), one expert e, its slots as the MMA's B columns: the expert's
        # weights are read once for up to MB tokens. FC 1: rows [pid_n * BN/2, + BN/2) of the
        # gate half and the same rows of the up half (N = I), which the mma layout gives one
        # thread together (row r and r + BN/2: BN = 32 W), so the program writes
        # y [S, I] = bf16(SiLU(gate) * up). FC 2: x = that [S, I]; y [S, N] float32 = the
        # slot's output times its routing weight (moe_slots.combine_slots sums a token's), or
        # with FOLD the program that writes the last of a token's placed slots (need[t] of
        # them, moe_slots.sort_for_fold) sums the token's slots in slot order into out [T, N]:
        # the same sum as combine_slots, with no launch for it.
        pid_n = gl.program_id(0)
        p = gl.program_id(1)
        mma: gl.constexpr = _mma_layout(W)
        LC: gl.constexpr = _code_layout(BN, BK // 8, W)
        LS: gl.constexpr = _scale_ptr_layout(BN, BK // 16, W, RING)
        LX: gl.constexpr = _x_layout(BK, MB, W)
        LE: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
        _pdl_enter(PDL)  # the tile map is written by the expert sort
        ev = gl.arange(0, EP, layout=LE)
        te = gl.load(tile_end_ptr + ev, mask=ev < E, other=1 << 30)
        e = gl.sum((te <= p).to(gl.int32), axis=0)  # E: p is past the last tile
        valid = e < E
        ec = gl.minimum(e, E - 1)
        cnt = gl.load(counts_ptr + ec)
        seg = gl.load(seg_start_ptr + ec)
        j0 = (p - (gl.load(tile_end_ptr + ec) - (cnt + MB - 1) // MB)) * MB
        last = gl.maximum(cnt - 1, 0)
        if RING:  # 4-byte cp.async of the scales (admitted_ring checked the host strides)
            stride_sn = stride_sn // 4 * 4
            stride_se = stride_se // 4 * 4
        codes_ptr += ec.to(gl.int64) * stride_ce
        scales_ptr += ec.to(gl.int64) * stride_se
        tidx_ptr += ec.to(gl.int64) * stride_te

        HB: gl.constexpr = BN // 2
        r = gl.arange(0, BN, layout=gl.SliceLayout(1, LC))
        rs = gl.arange(0, BN, layout=gl.SliceLayout(1, LS))
        if FC == 1:  # local row r: gate row pid_n * HB + r % HB, + N for the up half
            rows = gl.minimum(pid_n * HB + r % HB, N - 1) + (r // HB) * N
            rows_s = gl.minimum(pid_n * HB + rs % HB, N - 1) + (rs // HB) * N
        else:
            rows = gl.minimum(pid_n * BN + r, N - 1)
            rows_s = gl.minimum(pid_n * BN + rs, N - 1)
        cb = gl.arange(0, BK // 8, layout=gl.SliceLayout(0, LC))
        cptr = codes_ptr + rows.to(gl.int64)[:, None] * stride_cn + cb[None, :]
        sb = gl.arange(0, BK // 16, layout=gl.SliceLayout(0, LS))
        sptr = scales_ptr + rows_s.to(gl.int64)[:, None] * stride_sn + sb[None, :]
        nx = gl.arange(0, MB, layout=gl.SliceLayout(0, LX))
        slot_x = _slot_of(order_ptr, seg, j0, nx, last, S)
        xrow = slot_x // A if FC == 1 else slot_x
        kx = gl.arange(0, BK, layout=gl.SliceLayout(1, LX))
        xptr = x_ptr + xrow.to(gl.int64)[None, :] * stride_xm + kx[:, None]
        k1 = K * valid.to(gl.int32)  # an empty tile runs no K step
        if RING:
            acc = _mainloop_ring(cptr, sptr, xptr, x_ptr, k1 * 0, k1, K, BN, BK, MB, W, 0, RING, False)
        else:
            acc = _mainloop(cptr, sptr, xptr, x_ptr, k1 * 0, k1, K, BN, BK, MB, W, 0, PREFETCH, False)

        ro = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        if FC == 1:
            wrow = gl.minimum(pid_n * HB + ro % HB, N - 1) + (ro // HB) * N
        else:
            wrow = gl.minimum(pid_n * BN + ro, N - 1)
        if HAS_TIDX:
            acc = acc * (gl.load(ab_ptr + 2 * gl.load(tidx_ptr + wrow)) * gpost)[:, None]
        else:
            acc = acc * (gl.load(ab_ptr) * gpost)
        if FC == 1:
            g3 = gl.permute(gl.reshape(acc, [2, HB, MB]), [1, 2, 0])
            gate, up = gl.split(g3)
            act = _silu_mul(gate, up)
            LO: gl.constexpr = act.type.layout
            io = pid_n * HB + gl.arange(0, HB, layout=gl.SliceLayout(1, LO))
            no = gl.arange(0, MB, layout=gl.SliceLayout(0, LO))
            slot_o = _slot_of(order_ptr, seg, j0, no, last, S)
            ok = ((j0 + no) < cnt) & valid
            gl.store(y_ptr + slot_o.to(gl.int64)[None, :] * stride_ym + io[:, None],
                     act.to(y_ptr.dtype.element_ty), mask=(io < N)[:, None] & ok[None, :])
        else:
            no = gl.arange(0, MB, layout=gl.SliceLayout(0, mma))
            slot_o = _slot_of(order_ptr, seg, j0, no, last, S)
            ok = ((j0 + no) < cnt) & valid
            acc = acc * gl.load(tw_ptr + slot_o)[None, :]
            oro = pid_n * BN + ro
            gl.store(y_ptr + slot_o.to(gl.int64)[None, :] * stride_ym + oro[:, None],
                     acc.to(y_ptr.dtype.element_ty), mask=(oro < N)[:, None] & ok[None, :])
            if FOLD:
                gl.thread_barrier()  # the tile's rows are written before it counts as arrived
                tok = slot_o // A
                counter = sem_ptr + tok * gl.num_programs(0) + pid_n
                arrived = gl.atomic_add(counter, gl.full([MB], 1, gl.int32, layout=no.type.layout),
                                        mask=ok, sem="acq_rel", scope="gpu")
                done = ok & (arrived == gl.load(need_ptr + tok, mask=ok, other=0) - 1)
                for j in range(MB):
                    if gl.sum(gl.where((no == j) & done, 1, 0), axis=0) > 0:
                        t = gl.sum(gl.where(no == j, tok, 0), axis=0)
                        tot = gl.zeros([BN], gl.float32, layout=gl.SliceLayout(1, mma))
                        for a in range(A):
                            ea = gl.load(ids_ptr + t * A + a)
                            named = (ea >= 0) & (ea < E)
                            tot += gl.load(y_ptr + (t * A + a).to(gl.int64) * stride_ym + oro,
                                           mask=(oro < N) & named, other=0.0,
                                           cache_modifier=".cg")
                        gl.store(out_ptr + t.to(gl.int64) * stride_out + oro,
                                 tot.to(out_ptr.dtype.element_ty), mask=oro < N)
                        gl.atomic_xchg(sem_ptr + t * gl.num_programs(0) + pid_n, 0,
                                       sem="relaxed", scope="gpu")


def tc_moe_refusal(x: torch.Tensor, w13, w2, activation=None, b13=None, b2=None) -> str | None:
    """Why tc_moe_gemv cannot take this MoE call, or None."""
    if b13 is not None or b2 is not None:
        return "expert biases are not read"
    if activation is not None and activation.kind != "silu":
        return f"activation {activation.kind}: SiLU only"
    probe = x[:1]
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, LutWeight) or len(w.lead) != 1:
            return f"{name} is not a stack of LUT experts"
        reason = _shape_refusal(probe if name == "w13" else probe.new_empty(1, w.kp), w)
        if reason is not None:
            return f"{name}: {reason}"
    if w13.n != 2 * w2.kp:
        return "w13 rows are not twice w2's inputs"
    return _device_refusal(x)


def tc_moe_gemv(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: LutWeight,
                w2: LutWeight, config: dict | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE layer as per-slot tensor-core GEMVs (nvfp4 experts, SiLU, no biases): FC1
    [S, 2I] float32, FC2 with SiLU(gate) * up made on load, times the routing weight, each
    token's slots summed in order by FC2's last-arriving program. Two launches, no host
    read. Same contract as moe.fused_moe_gemv."""
    reason = tc_moe_refusal(x, w13, w2)
    assert reason is None, reason
    t, h = x.shape
    a_top = ids.shape[1]
    s = t * a_top
    inter = w2.kp
    cfg = config or launch.lookup("tc_moe", "nvfp4", w13.lead[0], h, t)
    x, ids_flat, tw = flat_slots(x, ids, weights)
    h1 = torch.empty(s, 2 * inter, dtype=torch.float32, device=x.device)
    y = moe_output(x, out)
    _launch(x, h1, None, w13, s, 2 * inter, h, dict(DEFAULT, **cfg.get("fc1", cfg)), s, 1,
            ids_flat, tw, a_top)
    _launch(h1, y, None, w2, s, h, inter, dict(DEFAULT, **cfg.get("fc2", cfg)), s, 2,
            ids_flat, tw, a_top)
    return y


# MB: slots of one expert a program takes as the MMA's B columns (8, 16 or 32): more columns
# read an expert fewer times when it has many tokens (prefill chunks), at more registers (sm_90,
# FC1 with BN 128: MB 16 195 registers at BK 256; MB 32 spills at BK 256, 202 registers at 128)
# FOLD (up to 512 slots): FC2's last-arriving program per token sums the token's slots and
# the sort is one program: three launches instead of five, but measured slower (H200,
# Qwen3-30B-A3B nvfp4: x8 / x32 / x64 1,525 / 3,172 / 5,297 against 1,545 / 3,429 / 6,104
# tok/s; docs/BENCHMARKS.md#decode-graph): off unless a config asks
GROUPED = {"BN": 128, "BK": 256, "num_warps": 4, "PREFETCH": True, "MB": 8, "FOLD": False}


def tc_moe_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: LutWeight,
                   w2: LutWeight, config: dict | None = None,
                   out: torch.Tensor | None = None, defer: bool = False) -> torch.Tensor | SlotSum:
    """The MoE layer with each expert's weights read once for all the tokens routed to it
    (nvfp4, SiLU, no biases): the slots sorted by expert on the device
    (moe_slots.sort_by_expert), FC1 on tiles of up to MB slots of one expert writing
    bf16(SiLU(gate) * up) [S, I], FC2 writing each slot's output times its routing weight
    [S, H], then the ordered sum per token (moe_slots.combine_slots, which skips a slot
    placed nowhere): five launches, three with the one-launch sort and defer. Config FOLD
    (off, measured slower): up to 512 slots a
    one-program sort and FC2's last-arriving program per token summing its slots, three
    launches. No host read. Same contract as
    moe.fused_moe_gemv. defer (with out None): a moe_slots.SlotSum instead of the combine
    launch, for the next RMSNorm to sum. Config RING: the K loops through tc_gemv's
    shared-memory ring (tc_gemv.admitted_ring decides where it fits)."""
    reason = tc_moe_refusal(x, w13, w2)
    assert reason is None, reason
    t, h = x.shape
    a_top = ids.shape[1]
    s = t * a_top
    e = w13.lead[0]
    inter = w2.kp
    cfg = dict(GROUPED, **(config or {}))
    bk, nw, mb = cfg["BK"], cfg["num_warps"], cfg["MB"]
    bn1 = 32 * nw  # FC1 pairs row r with r + BN / 2 in one thread (the mma layout's repeat)
    bn2 = cfg["BN"]
    x, ids_flat, tw = flat_slots(x, ids, weights)
    y = moe_output(x, out)
    fold = cfg["FOLD"] and sort_for_fold(ids_flat, e, mb, a_top, y)
    if fold:
        order, tile_end, seg_start, counts, tiles, need = fold
    else:
        order, tile_end, seg_start, counts, tiles = sort_by_expert(ids_flat, e, mb)
        need = counts
    act = torch.empty(s, inter, dtype=torch.bfloat16, device=x.device)
    ys = torch.empty(s, h, dtype=torch.float32, device=x.device)  # unplaced slots are not read
    ep = max(16, 1 << (e - 1).bit_length())
    sem = semaphore(x.device, t * -(-h // bn2))
    for fc, w, xin, yout, n, k, bn in ((1, w13, x, act, inter, h, bn1),
                                       (2, w2, act, ys, h, inter, bn2)):
        a = weight_args(w)
        kb = bk if k % bk == 0 else BK_UNIT
        ring = admitted_ring(int(cfg.get("RING", 0)), bn, kb, mb, 0, xin.element_size(),
                             _smem_limit(x.device.index or 0), ring_scales_aligned(a))
        grid_n = -(-n // (bn // 2 if fc == 1 else bn))
        launch.run(_tc_moe_grouped_kernel, (grid_n, tiles),
                   xin, yout, a.codes.view(torch.int32), a.scales.view(torch.uint8), a.ab,
                   a.tidx, tw, order, tile_end, seg_start, counts, ids_flat, need, y, sem,
                   y.stride(0), n, k, e, a_top, s,
                   xin.stride(0), yout.stride(0), a.stride_cn // 4, a.stride_sn,
                   a.stride_ce // 4, a.stride_se, a.stride_te, a.g * E2M1_BF16_POST, EP=ep,
                   HAS_TIDX=a.has_tidx, BN=bn, BK=kb, MB=mb, W=nw, FC=fc,
                   PREFETCH=int(cfg["PREFETCH"]), FOLD=bool(fold) and fc == 2,
                   RING=ring, num_warps=nw,
                   **launch.pdl_args(x))
    if fold:
        return y
    if defer and out is None and slot_fusion():
        return SlotSum(ys, ids_flat, a_top, e, y)
    return combine_slots(ys, x, a_top, ids_flat, e, y)
