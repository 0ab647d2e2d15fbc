"""Slot bookkeeping of the fused MoE: the device sort of routed slots by expert (grouped
tiles) and the ordered sum of each token's slot outputs, launched here (combine_slots) or
left to the next RMSNorm (SlotSum, lowbit.kernels.norm_op). No host reads: CUDA-graph safe.

Shape legend: T tokens, A experts per token (top-k), S = T * A slots, E experts, H hidden.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lowbit.kernels import launch
from lowbit.kernels.pdl import pdl_enter
from lowbit.kernels.runtime import tl, triton


@triton.jit
def _moe_combine_kernel(ys_ptr, y_ptr, ids_ptr, H, A, E, stride_yt, BN: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < H
    acc = tl.zeros([BN], tl.float32)
    for j in range(0, A):
        e = tl.load(ids_ptr + t * A + j)
        named = (e >= 0) & (e < E)  # a slot placed nowhere was never written: it adds 0
        acc += tl.load(ys_ptr + (t * A + j).to(tl.int64) * H + cols, mask=cmask & named, other=0)
    tl.store(y_ptr + t.to(tl.int64) * stride_yt + cols, acc.to(y_ptr.dtype.element_ty),
             mask=cmask)


@triton.jit
def _block_counts(ids_ptr, b, S, E, EP: tl.constexpr, BS: tl.constexpr):
    """[EP] int32: how many of slots b * BS .. + BS name each expert (ids outside 0..E-1 are
    counted nowhere)."""
    sl = b * BS + tl.arange(0, BS)
    ids = tl.load(ids_ptr + sl, mask=sl < S, other=-1)
    return tl.histogram(ids, EP, mask=(ids >= 0) & (ids < E))


@triton.jit
def _expert_hist_kernel(ids_ptr, hist_ptr, S, E, EP: tl.constexpr, BS: tl.constexpr,
                        PDL: tl.constexpr):
    """Program b: hist [b, :E] = _block_counts of block b."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    ev = tl.arange(0, EP)
    tl.store(hist_ptr + b * E + ev, _block_counts(ids_ptr, b, S, E, EP, BS), mask=ev < E)


@triton.jit
def _expert_sort_kernel(ids_ptr, order_ptr, tile_end_ptr, seg_start_ptr, counts_ptr, S, E,
                        need_ptr, out_ptr, T, A, H, stride_out,
                        EP: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr,
                        TOKENS: tl.constexpr, TP: tl.constexpr, BH: tl.constexpr,
                        PDL: tl.constexpr):
    """One program: the counting sort of _expert_hist_kernel + _expert_place_kernel for few
    slots, in one launch (the histogram over all blocks, then the blocks placed in order;
    same outputs bit for bit). TOKENS: also need [T] = how many of token t's A slots are
    placed (ids inside 0..E-1), and out [t, :H] = 0 for a token with none (no expert kernel
    will write it)."""
    pdl_enter(PDL)
    if TOKENS:
        tv = tl.arange(0, TP)
        tm = tv < T
        need = tl.zeros([TP], tl.int32)
        for a in range(0, A):
            e = tl.load(ids_ptr + tv * A + a, mask=tm, other=-1)
            need += ((e >= 0) & (e < E)).to(tl.int32)
        tl.store(need_ptr + tv, need, mask=tm)
        if tl.sum(((need == 0) & tm).to(tl.int32), 0) > 0:  # rare: a NaN routing row
            hv = tl.arange(0, BH)
            for t in range(0, T):
                dead = tl.sum(tl.where((tv == t) & (need == 0), 1, 0), 0) > 0
                if dead:
                    for h0 in range(0, H, BH):
                        tl.store(out_ptr + t * stride_out + h0 + hv,
                                 tl.zeros([BH], tl.float32).to(out_ptr.dtype.element_ty),
                                 mask=h0 + hv < H)
    ev = tl.arange(0, EP)
    em = ev < E
    total = tl.zeros([EP], tl.int32)
    for s0 in range(0, S, BS):
        sl = s0 + tl.arange(0, BS)
        ids = tl.load(ids_ptr + sl, mask=sl < S, other=-1)
        total += tl.sum((ids[:, None] == ev[None, :]).to(tl.int32), 0)
    seg = tl.cumsum(total, 0) - total
    tl.store(counts_ptr + ev, total, mask=em)
    tl.store(seg_start_ptr + ev, seg, mask=em)
    tl.store(tile_end_ptr + ev, tl.cumsum((total + BM - 1) // BM, 0), mask=em)
    before = seg
    for s0 in range(0, S, BS):
        sl = s0 + tl.arange(0, BS)
        ids = tl.load(ids_ptr + sl, mask=sl < S, other=-1)
        hit = (ids[:, None] == ev[None, :]).to(tl.int32)  # [BS, EP]
        rank = tl.cumsum(hit, 0) - 1
        pos = tl.sum(hit * before[None, :] + hit * rank, 1)
        named = tl.sum(hit, 1) > 0
        tl.store(order_ptr + pos, sl, mask=(sl < S) & named)
        before += tl.sum(hit, 0)


@triton.jit
def _expert_place_kernel(ids_ptr, hist_ptr, order_ptr, tile_end_ptr, seg_start_ptr, counts_ptr,
                         S, E, NB, EP: tl.constexpr, BS: tl.constexpr, RB: tl.constexpr,
                         BM: tl.constexpr, FROM_IDS: tl.constexpr, NBC: tl.constexpr,
                         PDL: tl.constexpr):
    """Program b: each slot of block b goes to order[seg_start[e] + (slots of e in blocks
    before b) + (its rank among e's slots in block b)]: a stable counting sort. Every program
    sums the [NB, E] histogram itself (no third launch); program 0 also writes counts,
    seg_start and tile_end (cumulative tiles of BM). FROM_IDS: every program counts the
    NBC (= NB) blocks' ids itself (the histogram of _expert_hist_kernel, never stored): one
    launch, the blocks' loads unrolled so that they are in flight together."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    ev = tl.arange(0, EP)
    em = ev < E
    total = tl.zeros([EP], tl.int32)
    before = tl.zeros([EP], tl.int32)
    if FROM_IDS:
        for r in tl.static_range(NBC):
            cnt = _block_counts(ids_ptr, r, S, E, EP, BS)
            total += cnt
            before += tl.where(r < b, cnt, 0)
    else:
        for r0 in range(0, NB, RB):
            rows = r0 + tl.arange(0, RB)
            h = tl.load(hist_ptr + rows[:, None] * E + ev[None, :],
                        mask=(rows[:, None] < NB) & em[None, :], other=0)
            total += tl.sum(h, 0)
            before += tl.sum(tl.where(rows[:, None] < b, h, 0), 0)
    seg = tl.cumsum(total, 0) - total
    if b == 0:
        tl.store(counts_ptr + ev, total, mask=em)
        tl.store(seg_start_ptr + ev, seg, mask=em)
        tl.store(tile_end_ptr + ev, tl.cumsum((total + BM - 1) // BM, 0), mask=em)
    sl = b * BS + tl.arange(0, BS)
    ids = tl.load(ids_ptr + sl, mask=sl < S, other=-1)
    hit = (ids[:, None] == ev[None, :]).to(tl.int32)  # [BS, EP]
    rank = tl.cumsum(hit, 0) - 1  # earlier slots of the same expert in this block
    pos = tl.sum(hit * (seg + before)[None, :] + hit * rank, 1)
    named = tl.sum(hit, 1) > 0  # an id outside 0..E-1 is placed nowhere
    tl.store(order_ptr + pos, sl, mask=(sl < S) & named)


def flat_slots(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """(x with unit column stride, ids_flat int32 [S], tw float32 [S]) of a routing ids /
    weights [T, A]: slot s = t * A + j, the order every fused MoE kernel indexes."""
    x = x if x.stride(1) == 1 else x.contiguous()
    return (x, ids.reshape(-1).to(torch.int32).contiguous(),
            weights.reshape(-1).to(torch.float32).contiguous())


def moe_output(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """y [T, H]: out (x.dtype or float32, unit column stride) or a new tensor in x.dtype."""
    t, h = x.shape
    y = torch.empty(t, h, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (t, h) and y.dtype in (x.dtype, torch.float32) and y.stride(1) == 1
    return y


# up to this many blocks of slots (8: 512 slots at 128 experts), one program could sort them
# (_expert_sort_kernel): one launch instead of two. Measured slower (H200, Qwen3-30B-A3B
# nvfp4 decode, with the folded FC2 sum: 14 / 25 us a call at 256 / 512 slots, x32 / x64
# 3,172 / 5,297 tok/s against 3,429 / 6,104 with the pair; docs/BENCHMARKS.md#decode-graph),
# so it is off: sort_for_fold uses it where asked
ONE_PROGRAM_SORT_BLOCKS = 0
# up to this many blocks of slots (16: 1,024 slots at 128 experts, every decode bucket to 128
# tokens of top-8), the placement programs count all the blocks' ids themselves
# (_expert_place_kernel FROM_IDS): one launch of NB parallel programs instead of the histogram
# launch + the placement. Each program counts NB blocks of BS ids (<= 1,024 ids at the
# limit), where the pair costs a launch and a round trip through memory
ONE_LAUNCH_SORT_BLOCKS = 16
FOLD_SORT_BLOCKS = 8  # sort_for_fold's limit (one program)


def slot_fusion() -> bool:
    """Whether the fused MoE saves its two slot launches where it can: the one-launch sort
    (ONE_LAUNCH_SORT_BLOCKS) and the combine deferred into the next RMSNorm (SlotSum).
    LOWBIT_SLOT_FUSION=0 turns both off (the A/B of docs/BENCHMARKS.md#decode-graph)."""
    return os.environ.get("LOWBIT_SLOT_FUSION", "1") != "0"


def _sort_blocks(s: int, e: int) -> tuple[int, int, int]:
    """(EP, BS, blocks) of the counting sort of s slots over e experts: a [BS, EP] one-hot
    of <= 8,192 int32 a block."""
    ep = max(16, triton.next_power_of_2(e))
    bs = max(16, min(256, 8192 // ep))
    return ep, bs, triton.cdiv(s, bs)


def sort_by_expert(ids_flat: torch.Tensor, e: int, bm: int):
    """Device-side grouping of the slots by expert, with no host read (CUDA-graph safe).

    ids_flat int32 [S] -> order int32 [S] (slots sorted by expert, stable), tile_end int32 [E]
    (cumulative tiles of BM slots), seg_start int32 [E] (first sorted position of each
    expert), counts int32 [E], and the grid bound ceil(S / BM) + min(E, S), which depends on
    shapes only. A counting sort in two launches (block histograms, then placement), where
    torch.sort + a scatter-add histogram + two cumsums took about ten; one launch up to
    ONE_LAUNCH_SORT_BLOCKS blocks of slots (each program counts every block). An id outside
    0..E-1 (a NaN routing row) is counted and placed nowhere: its slot is never computed.
    """
    s = ids_flat.numel()
    dev = ids_flat.device
    order = torch.empty(s, dtype=torch.int32, device=dev)
    tile_end = torch.empty(e, dtype=torch.int32, device=dev)
    seg_start = torch.empty_like(tile_end)
    counts = torch.empty_like(tile_end)
    if s:
        ep, bs, nb = _sort_blocks(s, e)
        pdl = launch.pdl_args(ids_flat)
        if nb <= ONE_PROGRAM_SORT_BLOCKS:
            launch.run(_expert_sort_kernel, (1,), ids_flat, order, tile_end, seg_start, counts,
                       s, e, counts, counts, 0, 1, 0, 0, EP=ep, BS=bs, BM=bm, TOKENS=False,
                       TP=16, BH=16, num_warps=4, **pdl)
        elif nb <= ONE_LAUNCH_SORT_BLOCKS and slot_fusion():
            launch.run(_expert_place_kernel, (nb,), ids_flat, ids_flat, order, tile_end,
                       seg_start, counts, s, e, nb, EP=ep, BS=bs, RB=1, BM=bm, FROM_IDS=True,
                       NBC=nb, num_warps=4, **pdl)
        else:
            rb = max(1, min(triton.next_power_of_2(nb), 8192 // ep))
            hist = torch.empty(nb, e, dtype=torch.int32, device=dev)
            launch.run(_expert_hist_kernel, (nb,), ids_flat, hist, s, e, EP=ep, BS=bs,
                       num_warps=4, **pdl)
            launch.run(_expert_place_kernel, (nb,), ids_flat, hist, order, tile_end, seg_start,
                       counts, s, e, nb, EP=ep, BS=bs, RB=rb, BM=bm, FROM_IDS=False,
                       NBC=1, num_warps=4, **pdl)
    else:
        tile_end.zero_(), seg_start.zero_(), counts.zero_()
    return order, tile_end, seg_start, counts, triton.cdiv(s, bm) + min(e, s)


def sort_for_fold(ids_flat: torch.Tensor, e: int, bm: int, a_top: int, out: torch.Tensor):
    """sort_by_expert in one program (up to FOLD_SORT_BLOCKS blocks of slots), for an expert kernel that
    sums each token's slots itself (the last of a token's slots to finish writes out[t]):
    also need int32 [T], how
    many of each token's slots are placed, with out[t] zeroed for a token that has none.
    None when the slots are too many for one program (then: sort_by_expert, combine_slots)."""
    s = ids_flat.numel()
    ep, bs, nb = _sort_blocks(s, e)
    if s == 0 or nb > FOLD_SORT_BLOCKS:
        return None
    t, h = out.shape
    dev = ids_flat.device
    order = torch.empty(s, dtype=torch.int32, device=dev)
    tile_end, seg_start, counts = (torch.empty(e, dtype=torch.int32, device=dev) for _ in range(3))
    need = torch.empty(t, dtype=torch.int32, device=dev)
    launch.run(_expert_sort_kernel, (1,), ids_flat, order, tile_end, seg_start, counts, s, e,
               need, out, t, a_top, h, out.stride(0), EP=ep, BS=bs, BM=bm, TOKENS=True,
               TP=max(16, triton.next_power_of_2(t)), BH=min(1024, triton.next_power_of_2(h)),
               num_warps=4, **launch.pdl_args(ids_flat))
    return order, tile_end, seg_start, counts, triton.cdiv(s, bm) + min(e, s), need


def combine_slots(ys: torch.Tensor, x: torch.Tensor, a_top: int, ids_flat: torch.Tensor, e: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, H] = the ordered sum of each token's A routed slot outputs ys [T * A, H] (one
    launch, deterministic); in x.dtype, or into out (x.dtype or float32). A slot whose id
    (ids_flat [T * A]) is outside 0..e-1 was placed nowhere: its row of ys is never read."""
    t, h = x.shape
    y = torch.empty(t, h, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (t, h) and y.dtype in (x.dtype, torch.float32) and y.stride(1) == 1
    bnc = min(1024, triton.next_power_of_2(h))
    launch.run(_moe_combine_kernel, (t, triton.cdiv(h, bnc)), ys, y, ids_flat, h, a_top, e,
               y.stride(0),
               BN=bnc, num_warps=4, **launch.pdl_args(ys))
    return y


@dataclass
class SlotSum:
    """A fused MoE's output y [T, H] before its last launch: y[t] = the ordered sum of token
    t's slot rows ys [t * A + j] whose expert id is inside 0..E-1, rounded once to out's dtype
    (what combine_slots writes). A caller that asked for it (defer=True) hands it to the next
    RMSNorm (lowbit.kernels.norm_op.rms_norm), whose kernel sums the slots itself: the combine
    costs no launch. Only a caller whose next op is that norm asks for one (CausalLM.forward's
    decoder layers)."""

    ys: torch.Tensor  # [T * A, H] float32
    ids_flat: torch.Tensor  # [T * A] int32
    a_top: int
    num_experts: int
    out: torch.Tensor  # [T, H] in the activations' dtype, unit strides: where y goes
    # [T, H] in out's dtype, added to the rounded sum and rounded again (the block's shared
    # experts: y = routed + shared, as the unfused op adds them)
    extra: torch.Tensor | None = None


def reference_slot_sum(slots: SlotSum) -> torch.Tensor:
    """The torch twin of combine_slots: float32 sums in slot order, one rounding (then
    extra added, rounded again)."""
    t, h = slots.out.shape
    ys = slots.ys.view(t, slots.a_top, h)
    named = ((slots.ids_flat >= 0) & (slots.ids_flat < slots.num_experts)).view(t, slots.a_top)
    acc = torch.zeros(t, h, dtype=torch.float32, device=ys.device)
    for j in range(slots.a_top):
        acc = acc + torch.where(named[:, j, None], ys[:, j], 0.0)
    y = acc.to(slots.out.dtype)
    return y if slots.extra is None else y + slots.extra

