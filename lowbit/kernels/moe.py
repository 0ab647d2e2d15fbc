"""Fused MoE experts: y[t] = sum_j w[t, j] * (W2_e act(W13_e x[t] + b13_e) + b2_e), e = ids[t, j].

Shape legend: T tokens, H hidden, I expert width, E experts, A = top-k, S = T * A slots
(slot s = t * A + j), BM slot rows per tile, BN output columns per tile, BK reduction step.
Weights: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], each a stacked LUT
view, fp8 view or dense tensor, decoded tile by tile in registers (lowbit.kernels.decode);
no [E, N, K] transient is ever materialised. Optional expert biases b13 [E, 2I] and b2 [E, H]
(float, contiguous) and the activation act(gate, up) of FC1's two halves: SiLU(gate) * up, or
gpt-oss's clamped SwiGLU (lowbit.kernels.moe_op.MoeActivation; dequant_gemm.gated_act).
Constexpr flags (HAS_BIAS, SWIGLU) compile the biases and the clamp in only where used.

Three launches, all reading ids and weights from device memory (no host read: CUDA-graph
safe, the grid depends only on T, A and E):
  1. FC1 + gate: h [S, I] float32, h[s] = act(x[t] Wg^T + b13g, x[t] Wu^T + b13u).
  2. FC2 with the routing weight: ys [S, H] float32, ys[s] = w[t, j] * (h[s] W2^T + b2).
  3. combine: y[t] = sum over j = 0 .. A-1 of ys[t * A + j], in that order (deterministic:
     no atomics), cast to x.dtype.
A tile of launches 1-2 owns one expert and up to BM of its slots, so an expert's weights are
read once per tile column whatever the number of tokens routed to it. Two ways to map a
program to (expert, slots):
  decode (S <= 256): program p takes the p-th distinct expert of ids (ascending), found
    in-kernel from an [E, S] comparison; its slots are compacted with a prefix sum
    (invariant: at most BM slots per expert, so BM >= T). Programs past the count exit.
  grouped (prefill): slots sorted by expert on the device (moe_slots.sort_by_expert: a stable
    counting sort in two launches, no host read); each expert's run is cut into tiles
    of BM; program p finds its expert from the cumulative tile counts. The grid is the bound
    ceil(S / BM) + min(E, S) tiles, so the whole route can be captured in a CUDA graph.
Reference twin: `reference_moe` (loop over experts, the format's decode, float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.formats.views import DenseWeight, Fp8View, LutWeight
from lowbit.kernels import launch
from lowbit.kernels.decode import (
    WeightArgs,
    dot_tile,
    dot_tile_post,
    e2m1_bf16,
    exact_tiles,
    row_tables,
    weight_args,
)
from lowbit.kernels.dequant_gemm import _gemv_codes, _gemv_kernel, gated_act, split_plan
from lowbit.kernels.moe_layout import DenseShared
from lowbit.kernels.moe_slots import (
    SlotSum,
    combine_slots,
    flat_slots,
    moe_output,
    slot_fusion,
    sort_by_expert,
)
from lowbit.kernels.runtime import (
    interpreting,
    round_for_dot,
    semaphore,
    tl,
    triton,
)
from lowbit.kernels.weights import DECODE_NAMES, Resolved, expert_dense

ACTIVATIONS = ("silu", "swiglu_oai")


@dataclass(frozen=True)
class MoeActivation:
    """act(gate, up) of FC1's two halves. kind "silu": SiLU(gate) * up. kind "swiglu_oai"
    (gpt-oss): gate' = min(gate, limit), up' = clamp(up, -limit, limit),
    act = gate' * sigmoid(alpha * gate') * (up' + 1)."""

    kind: str = "silu"
    limit: float = 0.0
    alpha: float = 1.702

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"MoE activation {self.kind!r}: use one of {', '.join(ACTIVATIONS)}")
        if self.kind == "swiglu_oai" and not self.limit > 0:
            raise ValueError(f"swiglu_oai needs a positive clamp limit, got {self.limit}")


SILU = MoeActivation()


def bias_refusal(x: torch.Tensor, w13: Resolved, w2: Resolved, b13: torch.Tensor | None,
                 b2: torch.Tensor | None) -> str | None:
    """Why b13 [E, 2I] / b2 [E, H] do not fit these expert stacks, or None."""
    if len(w13.lead) != 1:
        return None  # not a stack: moe_refusal says so
    for name, b, n in (("b13", b13, w13.n), ("b2", b2, w2.n)):
        if b is None:
            continue
        if tuple(b.shape) != (w13.lead[0], n):
            return f"{name} is {list(b.shape)}, expected [{w13.lead[0]}, {n}]"
        if not b.is_floating_point() or b.device != x.device:
            return f"{name} is {b.dtype} on {b.device}, expected a float tensor on {x.device}"
    return None


MODE_DECODE = 0
MODE_GROUPED = 1


def dense_shared_refusal(w13: Resolved, w2: Resolved, shared: DenseShared) -> str | None:
    """Why the shared MLP cannot ride in the routed gemv launches, or None."""
    if not isinstance(w13, DenseWeight) or not isinstance(w2, DenseWeight):
        return f"routed experts are {type(w13).__name__}: the in-launch shared slots read dense stacks"
    gu, dn, n = shared.gate_up, shared.down, shared.n
    inter = w13.n // 2
    if gu.dtype != w13.w.dtype or dn.dtype != w2.w.dtype or gu.device != w13.w.device:
        return f"shared weights are {gu.dtype} on {gu.device}, routed {w13.w.dtype} on {w13.w.device}"
    if n < 1 or tuple(gu.shape) != (2 * n * inter, w13.kp) or tuple(dn.shape) != (w2.n, n * inter):
        return f"shared gate_up {list(gu.shape)} / down {list(dn.shape)} are not {n} experts of width {inter}"
    if not (gu.is_contiguous() and dn.is_contiguous()) or gu.element_size() != 2 or inter % 2:
        return "shared weights must be contiguous 16-bit tensors of an even expert width"
    return None


def _shared_args(w: Resolved, shared: DenseShared | None, fc: int) -> tuple[int, int, int, int]:
    """(sh_base, sh_ce, sh_cw, sh_gap) in 32-bit words for _gemv_kernel's shared slots of
    FC `fc` (1: gate_up, 2: down); sh_base is counted from w's words (another allocation:
    the kernel adds it to the routed pointer, as CUDA's flat address space allows)."""
    if shared is None:
        return 0, 0, 0, 0
    words, _, _ = _gemv_codes(w)
    t = shared.gate_up if fc == 1 else shared.down
    delta = t.data_ptr() - words.data_ptr()
    assert delta % 4 == 0, "16-bit weights start on 32-bit words"
    inter = w.n // 2 if fc == 1 else w.kp
    if fc == 1:  # rows: expert c's gate rows at c I, its up rows S - I further on
        row = t.shape[1] // 2
        return delta // 4, inter * row, row, (shared.n - 1) * inter * row
    return delta // 4, inter // 2, t.shape[1] // 2, 0  # down: column block c


@triton.jit
def _tile_slots(ids_ptr, order_ptr, tile_end_ptr, seg_start_ptr, counts_ptr, S, E, pid,
                MODE: tl.constexpr, SP: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr):
    """(expert, slots [BM], valid [BM], live) of program pid."""
    if MODE == 0:
        sl = tl.arange(0, SP)
        ids = tl.load(ids_ptr + sl, mask=sl < S, other=-1)
        ev = tl.arange(0, EP)
        present = tl.max((ids[None, :] == ev[:, None]).to(tl.int32), 1)  # [EP]
        rank = tl.cumsum(present, 0) - 1
        e = tl.sum(tl.where((present == 1) & (rank == pid), ev, 0), 0)
        live = pid < tl.sum(present, 0)
        hit = ids == e
        pos = tl.cumsum(hit.to(tl.int32), 0) - 1
        r = tl.arange(0, BM)
        sel = hit[None, :] & (pos[None, :] == r[:, None])  # [BM, SP]
        slots = tl.sum(tl.where(sel, sl[None, :], 0), 1)
        valid = tl.sum(sel.to(tl.int32), 1) > 0
    else:
        ev = tl.arange(0, EP)
        ends = tl.load(tile_end_ptr + ev, mask=ev < E, other=2147483647)
        e = tl.sum((ends <= pid).to(tl.int32), 0)
        live = e < E
        e = tl.minimum(e, E - 1)
        end = tl.load(tile_end_ptr + e)
        cnt = tl.load(counts_ptr + e)
        first = end - (cnt + BM - 1) // BM
        r = tl.load(seg_start_ptr + e) + (pid - first) * BM + tl.arange(0, BM)
        valid = (r < tl.load(seg_start_ptr + e) + cnt) & live
        slots = tl.load(order_ptr + r, mask=valid, other=0)
    return e, slots, valid & live, live


@triton.jit
def _expert_rows(e, rows, rmask, tidx_ptr, ab_ptr, stride_ce, stride_cn, stride_te, stride_se,
                 stride_sn, stride_oe, stride_on, BITS: tl.constexpr, SROWS: tl.constexpr,
                 HAS_TIDX: tl.constexpr, HAS_AB: tl.constexpr, BN: tl.constexpr):
    """Per-row offsets of expert e's rows: codes, scales, offsets, table base, alpha, beta."""
    e64 = e.to(tl.int64)
    row_off = e64 * stride_ce + rows.to(tl.int64) * stride_cn
    srow_off = e64 * stride_se + (rows // SROWS).to(tl.int64) * stride_sn
    orow_off = e64 * stride_oe + rows.to(tl.int64) * stride_on
    t, alpha, beta = row_tables(tidx_ptr + e64 * stride_te, ab_ptr, rows, rmask, BN, HAS_TIDX,
                                HAS_AB)
    return row_off, srow_off, orow_off, t * (1 << BITS), alpha, beta


@triton.jit
def _moe_fc1_kernel(
    x_ptr, h_ptr, bias_ptr, ids_ptr, order_ptr, tile_end_ptr, seg_start_ptr, counts_ptr,
    codes_ptr, table_ptr, tidx_ptr, ab_ptr, scales_ptr, offs_ptr,
    S, E, H, I, KC, A, stride_xt, stride_ce, stride_cn, stride_te, stride_se, stride_sn,  # noqa: E741
    stride_oe, stride_on, g,
    BITS: tl.constexpr, DECODE: tl.constexpr, SCALE_KIND: tl.constexpr, B: tl.constexpr,
    SROWS: tl.constexpr, HAS_TIDX: tl.constexpr, HAS_AB: tl.constexpr, HAS_OFFS: tl.constexpr,
    MODE: tl.constexpr, SP: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr, HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr, E2M1_BF16: tl.constexpr,
    ASM: tl.constexpr,
):
    e, slots, valid, live = _tile_slots(ids_ptr, order_ptr, tile_end_ptr, seg_start_ptr,
                                        counts_ptr, S, E, tl.program_id(0), MODE, SP, EP, BM)
    if live:
        cols = tl.program_id(1) * BN + tl.arange(0, BN)  # h columns = gate rows
        cmask = cols < I
        tok = (slots // A).to(tl.int64)
        gr = _expert_rows(e, cols, cmask, tidx_ptr, ab_ptr, stride_ce, stride_cn, stride_te,
                          stride_se, stride_sn, stride_oe, stride_on, BITS, SROWS, HAS_TIDX,
                          HAS_AB, BN)
        ur = _expert_rows(e, cols + I, cmask, tidx_ptr, ab_ptr, stride_ce, stride_cn,
                          stride_te, stride_se, stride_sn, stride_oe, stride_on, BITS, SROWS,
                          HAS_TIDX, HAS_AB, BN)
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            xt = tl.load(x_ptr + tok[:, None] * stride_xt + kk[None, :],
                         mask=valid[:, None] & (kk < H)[None, :], other=0)
            wg = dot_tile(codes_ptr, table_ptr, scales_ptr, offs_ptr, gr[0], gr[3], gr[4], gr[5],
                          gr[1], gr[2], cmask, k0, KC, g, BN, BK, BITS, DECODE, SCALE_KIND, B,
                          HAS_AB, HAS_OFFS, E2M1_BF16, ASM)
            wu = dot_tile(codes_ptr, table_ptr, scales_ptr, offs_ptr, ur[0], ur[3], ur[4], ur[5],
                          ur[1], ur[2], cmask, k0, KC, g, BN, BK, BITS, DECODE, SCALE_KIND, B,
                          HAS_AB, HAS_OFFS, E2M1_BF16, ASM)
            if DOT_F32:
                xf = xt.to(tl.bfloat16).to(tl.float32)
                acc_g = tl.dot(xf, tl.trans(wg.to(tl.bfloat16).to(tl.float32)), acc_g,
                               input_precision="ieee")
                acc_u = tl.dot(xf, tl.trans(wu.to(tl.bfloat16).to(tl.float32)), acc_u,
                               input_precision="ieee")
            else:
                xb = xt.to(tl.bfloat16)
                acc_g = tl.dot(xb, tl.trans(wg.to(tl.bfloat16)), acc_g)
                acc_u = tl.dot(xb, tl.trans(wu.to(tl.bfloat16)), acc_u)
        acc_g = dot_tile_post(acc_g, gr[4], g, E2M1_BF16)
        acc_u = dot_tile_post(acc_u, ur[4], g, E2M1_BF16)
        if HAS_BIAS:  # b13 [E, 2I]: gate half, then up half
            brow = bias_ptr + e.to(tl.int64) * (2 * I)
            acc_g += tl.load(brow + cols, mask=cmask, other=0).to(tl.float32)[None, :]
            acc_u += tl.load(brow + I + cols, mask=cmask, other=0).to(tl.float32)[None, :]
        hval = gated_act(acc_g, acc_u, SWIGLU, LIMIT, ALPHA)
        tl.store(h_ptr + slots.to(tl.int64)[:, None] * I + cols[None, :], hval,
                 mask=valid[:, None] & cmask[None, :])


@triton.jit
def _moe_fc2_kernel(
    h_ptr, ys_ptr, tw_ptr, bias_ptr, ids_ptr, order_ptr, tile_end_ptr, seg_start_ptr, counts_ptr,
    codes_ptr, table_ptr, tidx_ptr, ab_ptr, scales_ptr, offs_ptr,
    S, E, H, I, KC, stride_ce, stride_cn, stride_te, stride_se, stride_sn, stride_oe,  # noqa: E741
    stride_on, g,
    BITS: tl.constexpr, DECODE: tl.constexpr, SCALE_KIND: tl.constexpr, B: tl.constexpr,
    SROWS: tl.constexpr, HAS_TIDX: tl.constexpr, HAS_AB: tl.constexpr, HAS_OFFS: tl.constexpr,
    MODE: tl.constexpr, SP: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr, HAS_BIAS: tl.constexpr,
    E2M1_BF16: tl.constexpr, ASM: tl.constexpr,
):
    e, slots, valid, live = _tile_slots(ids_ptr, order_ptr, tile_end_ptr, seg_start_ptr,
                                        counts_ptr, S, E, tl.program_id(0), MODE, SP, EP, BM)
    if live:
        cols = tl.program_id(1) * BN + tl.arange(0, BN)  # output hidden columns
        cmask = cols < H
        sl = slots.to(tl.int64)
        wr = _expert_rows(e, cols, cmask, tidx_ptr, ab_ptr, stride_ce, stride_cn, stride_te,
                          stride_se, stride_sn, stride_oe, stride_on, BITS, SROWS, HAS_TIDX,
                          HAS_AB, BN)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            ht = tl.load(h_ptr + sl[:, None] * I + kk[None, :],
                         mask=valid[:, None] & (kk < I)[None, :], other=0)
            w = dot_tile(codes_ptr, table_ptr, scales_ptr, offs_ptr, wr[0], wr[3], wr[4], wr[5],
                         wr[1], wr[2], cmask, k0, KC, g, BN, BK, BITS, DECODE, SCALE_KIND, B,
                         HAS_AB, HAS_OFFS, E2M1_BF16, ASM)
            if DOT_F32:
                acc = tl.dot(ht.to(tl.bfloat16).to(tl.float32),
                             tl.trans(w.to(tl.bfloat16).to(tl.float32)), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(ht.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
        acc = dot_tile_post(acc, wr[4], g, E2M1_BF16)
        if HAS_BIAS:  # b2 [E, H], before the routing weight
            acc += tl.load(bias_ptr + e.to(tl.int64) * H + cols, mask=cmask,
                           other=0).to(tl.float32)[None, :]
        rw = tl.load(tw_ptr + sl, mask=valid, other=0)
        tl.store(ys_ptr + sl[:, None] * H + cols[None, :], acc * rw[:, None],
                 mask=valid[:, None] & cmask[None, :])


def moe_fmt_keys(w: Resolved) -> tuple[str, ...]:
    """Launch-config keys of an expert stack, most specific first: nvfp4 and int4 share
    "lut4" but decode differently (exact bf16x2 tiles against the float32 chain), so their
    measured tiles differ ("lut4-e2m1-e4m3-16" first, then "lut4")."""
    if isinstance(w, DenseWeight):
        return ("dense",)
    if isinstance(w, Fp8View):
        return ("fp8",)
    v = w.view
    return (f"lut{v.bits}-{DECODE_NAMES[w.decode]}-{v.scale_kind}-{v.block_size}", f"lut{v.bits}")


def _launch_args(a: WeightArgs, bf16_tiles: bool = True) -> tuple[list, dict]:
    ptrs = [a.codes, a.table, a.tidx, a.ab, a.scales, a.offs]
    strides = [a.stride_ce, a.stride_cn, a.stride_te, a.stride_se, a.stride_sn, a.stride_oe,
               a.stride_on, a.g]
    consts = dict(BITS=a.bits, DECODE=a.decode, SCALE_KIND=a.scale_kind, B=a.block,
                  SROWS=a.srows, HAS_TIDX=a.has_tidx, HAS_AB=a.has_ab, HAS_OFFS=a.has_offs,
                  E2M1_BF16=bf16_tiles and e2m1_bf16(a), ASM=not interpreting())
    return ptrs + strides, consts


def act_consts(activation: MoeActivation | None) -> dict:
    """The kernels' constexprs for an activation (None: SiLU)."""
    if activation is None or activation.kind == "silu":
        return dict(SWIGLU=False, LIMIT=0.0, ALPHA=0.0)
    return dict(SWIGLU=True, LIMIT=float(activation.limit), ALPHA=float(activation.alpha))


def torch_act(h: torch.Tensor, activation: MoeActivation | None) -> torch.Tensor:
    """act(gate, up) of h [*, 2I] (gate columns, then up columns) -> [*, I], in h's dtype."""
    gate, up = h.chunk(2, dim=-1)
    if activation is None or activation.kind == "silu":
        return torch.nn.functional.silu(gate) * up
    lim = activation.limit
    gate, up = gate.clamp(max=lim), up.clamp(-lim, lim)
    return gate * torch.sigmoid(gate * activation.alpha) * (up + 1)


def moe_refusal(x: torch.Tensor, w13: Resolved, w2: Resolved) -> str | None:
    """Why the fused kernels cannot take these weights, or None."""
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, (DenseWeight, LutWeight, Fp8View)):
            return f"{name} is {type(w).__name__}: no fused MoE kernel reads it"
        if len(w.lead) != 1:
            return f"{name} is not a stack of experts [E, N, K]"
        if isinstance(w, LutWeight) and w.view.table_index is not None and w.view.table_index.stride(-1) != 1:
            return f"{name} table_index rows are not contiguous"
    if w13.lead != w2.lead:
        return "w13 and w2 have different expert counts"
    if w13.n % 2 or w13.kp < x.shape[1] or w2.n != x.shape[1] or w2.kp < w13.n // 2:
        return f"shapes disagree: x {list(x.shape)}, w13 [{w13.n}, {w13.kp}], w2 [{w2.n}, {w2.kp}]"
    return None


def _bias_arg(b: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The kernels' bias pointer: b contiguous, or x (unread) when there is none."""
    return x if b is None else b.contiguous()


def _check_routing(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
    """Launcher invariants of the routing tensors (the moe op builds them this way)."""
    assert x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    assert ids.shape == weights.shape and ids.dim() == 2 and ids.shape[0] == x.shape[0]
    assert ids.dtype in (torch.int32, torch.int64) and weights.is_floating_point()
    assert ids.device == x.device == weights.device, "routing tensors on the activations' device"


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: Resolved,
              w2: Resolved, mode: str = "decode", config: dict | None = None,
              out: torch.Tensor | None = None, *, b13: torch.Tensor | None = None,
              b2: torch.Tensor | None = None,
              activation: MoeActivation | None = None, defer: bool = False) -> torch.Tensor | SlotSum:
    """y [T, H] in x.dtype (or out's float32); mode "decode" (S <= 256) or "grouped".
    defer (with out None): a moe_slots.SlotSum instead of the combine launch."""
    assert moe_refusal(x, w13, w2) is None, moe_refusal(x, w13, w2)
    assert bias_refusal(x, w13, w2, b13, b2) is None, bias_refusal(x, w13, w2, b13, b2)
    _check_routing(x, ids, weights)
    t, h = x.shape
    a_top = ids.shape[1]
    s = t * a_top
    e = w13.lead[0]
    inter = w13.n // 2
    x, ids_flat, tw = flat_slots(x, ids, weights)
    cfg = config or launch.lookup(f"moe_{mode}", moe_fmt_keys(w13), e, h, t)
    if mode == "decode":
        assert s <= 256, "the decode mapping takes at most 256 slots"
        bm = max(16, triton.next_power_of_2(t))
        tiles = min(e, s)
        order = tile_end = seg_start = counts = ids_flat
        mode_id = MODE_DECODE
    else:
        bm = cfg.get("BM", 64)
        order, tile_end, seg_start, counts, tiles = sort_by_expert(ids_flat, e, bm)
        mode_id = MODE_GROUPED
    common = dict(MODE=mode_id, SP=max(16, triton.next_power_of_2(s)),
                  EP=max(16, triton.next_power_of_2(e)), BM=bm, DOT_F32=interpreting(),
                  num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2))
    hbuf = torch.empty(s, inter, dtype=torch.float32, device=x.device)
    ys = torch.empty(s, h, dtype=torch.float32, device=x.device)
    a1, c1 = _launch_args(weight_args(w13), cfg.get("E2M1_BF16", True))
    launch.run(_moe_fc1_kernel, (tiles, triton.cdiv(inter, cfg["BN1"])),
        x, hbuf, _bias_arg(b13, x), ids_flat, order, tile_end, seg_start, counts, *a1[:6], s,
        e, h, inter, w13.kp, a_top, x.stride(0), *a1[6:], **c1, BN=cfg["BN1"], BK=cfg["BK1"],
        HAS_BIAS=b13 is not None, **act_consts(activation), **common)
    a2, c2 = _launch_args(weight_args(w2), cfg.get("E2M1_BF16", True))
    launch.run(_moe_fc2_kernel, (tiles, triton.cdiv(h, cfg["BN2"])),
        hbuf, ys, tw, _bias_arg(b2, x), ids_flat, order, tile_end, seg_start, counts, *a2[:6],
        s, e, h, inter, w2.kp, *a2[6:], **c2, BN=cfg["BN2"], BK=cfg["BK2"],
        HAS_BIAS=b2 is not None, **common)
    if defer and out is None and slot_fusion():
        return SlotSum(ys, ids_flat, a_top, e, moe_output(x, None))
    return combine_slots(ys, x, a_top, ids_flat, e, out)


def _gemv_fc(x: torch.Tensor, w: Resolved, k: int, y: torch.Tensor, moe: int,
             ids_flat: torch.Tensor, tw: torch.Tensor, a_top: int, cfg: dict,
             bias: torch.Tensor | None, act: dict, order: torch.Tensor | None = None,
             shared: DenseShared | None = None) -> None:
    """One expert layer as per-slot GEMVs from rows of x (see dequant_gemm._gemv_kernel,
    MOE modes 1 and 2); bias [E, N] or None. FC1 (moe 1): y [S, N] float32; FC2 (moe 2):
    y [T, N], each token's A slots summed in order (COMBINE). order: the slots sorted by
    expert, the launch order of the programs (None: slot order). shared: each token has
    shared.n more slots after its A routed ones (S = T * (A + n))."""
    a = weight_args(w)
    codes, stride_cw, kw = _gemv_codes(w)
    nsh = 0 if shared is None else shared.n
    assert nsh == 0 or (bias is None and order is None)
    s = ids_flat.numel() // a_top * (a_top + nsh)
    n = y.shape[1]
    combine = moe == 2
    bn = min(cfg["BN"], 16) if a.has_offs else cfg["BN"]
    grid_n = triton.cdiv(n, bn)
    split, w_split = split_plan(cfg, kw, grid_n * s)
    parts = split if split > 1 or combine else 1
    ws = torch.empty(parts, s, n, dtype=torch.float32, device=x.device)
    sem = semaphore(x.device, grid_n * s)
    launch.run(
        _gemv_kernel, (grid_n, split, s),
        x, y, _bias_arg(bias, x), ws, sem, codes, a.table, a.tidx, a.ab, a.scales, a.offs,
        s, n, k, kw, w_split, x.stride(0), y.stride(0), stride_cw, a.stride_sn, a.stride_on,
        a.g, 0x3F800000, ids_flat, tw, a_top, codes.stride(0), a.stride_te, a.stride_se,
        a.stride_oe, split, ids_flat if order is None else order, *_shared_args(w, shared, moe), BITS=a.bits, DECODE=a.decode, SCALE_KIND=a.scale_kind, B=a.block,
        SROWS=a.srows, HAS_TIDX=a.has_tidx, HAS_AB=a.has_ab, HAS_OFFS=a.has_offs,
        HAS_BIAS=bias is not None, BM=1, BN=bn, G=cfg["G"], SPLIT=split > 1,
        ASM=not interpreting(), PREFETCH=cfg.get("PREFETCH", True), MOE=moe, COMBINE=combine, **act,
        ORDER=order is not None, NSH=nsh,
        num_warps=cfg.get("num_warps", 4), num_stages=1,
    )


def fused_moe_gemv(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: Resolved,
                   w2: Resolved, config: dict | None = None,
                   out: torch.Tensor | None = None, *, b13: torch.Tensor | None = None,
                   b2: torch.Tensor | None = None,
                   activation: MoeActivation | None = None,
                   shared: DenseShared | None = None) -> torch.Tensor:
    """Decode as per-slot GEMVs (LUT, fp8 or bf16 experts): FC1 (+ b13) [S, 2I], FC2 with the
    activation made on load, + b2, times the routing weight, each token's slots summed in
    order by FC2's last-arriving program. Two launches, no host read; an expert used by
    several tokens is read once per token (from L2 when they coincide). Config SORT_SLOTS
    (off by default: no GPU record yet): launch the slots sorted by expert (a stable
    torch.sort of the ids, no host read) so that one expert's programs run together and its
    repeats hit L2. shared (dense experts, SiLU, no biases): the block's shared MLP as
    shared.n more slots of every token at weight 1.0, in the same two launches (y is then
    routed + shared; SORT_SLOTS is off for it)."""
    assert moe_refusal(x, w13, w2) is None, moe_refusal(x, w13, w2)
    assert bias_refusal(x, w13, w2, b13, b2) is None, bias_refusal(x, w13, w2, b13, b2)
    _check_routing(x, ids, weights)
    if shared is not None:
        assert dense_shared_refusal(w13, w2, shared) is None, dense_shared_refusal(w13, w2, shared)
        assert b13 is None and b2 is None and (activation is None or activation.kind == "silu")
    t, h = x.shape
    a_top = ids.shape[1]
    s = t * (a_top + (0 if shared is None else shared.n))
    inter = w13.n // 2
    cfg = config or launch.lookup("moe_gemv", moe_fmt_keys(w13), w13.lead[0], h, t)
    x, ids_flat, tw = flat_slots(x, ids, weights)
    h1 = torch.empty(s, 2 * inter, dtype=torch.float32, device=x.device)
    y = moe_output(x, out)
    act = act_consts(activation)
    order = None
    if cfg.get("SORT_SLOTS") and shared is None:  # every slot stays in the order, whatever its id
        order = torch.sort(ids_flat, stable=True).indices.to(torch.int32)
    _gemv_fc(x, w13, h, h1, 1, ids_flat, tw, a_top, cfg.get("fc1", cfg), b13, act, order, shared)
    _gemv_fc(h1, w2, inter, y, 2, ids_flat, tw, a_top, cfg.get("fc2", cfg), b2, act, order, shared)
    return y


def reference_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: Resolved,
                  w2: Resolved, dot_dtype: torch.dtype | None = None, *,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  activation: MoeActivation | None = None) -> torch.Tensor:
    """Torch twin: for each expert used, decode its weights with the format's reference and
    run the gated MLP (biases, activation) in float32; sum the routed outputs; cast to
    x.dtype. dot_dtype=torch.bfloat16 rounds x, the decoded weights (unless exact_tiles) and
    h where the kernels do (the biases are added to the float32 accumulators, unrounded). Entries of weight 0
    add nothing and are skipped: a CPU matmul's rows change with its row count, so an
    expert cache's masked entries (weight 0) must not join an expert's rows."""
    h = x.shape[1]
    inter = w13.n // 2
    out_dtype = x.dtype
    rnd = (lambda t: t) if dot_dtype is None else (lambda t: round_for_dot(t, dot_dtype))
    x = rnd(x.float())
    rnd_w13 = (lambda t: t) if exact_tiles(w13) else rnd  # exact bf16 tiles: nothing to round
    rnd_w2 = (lambda t: t) if exact_tiles(w2) else rnd
    out = torch.zeros(x.shape[0], h, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids[weights != 0]).tolist():  # host read: reference path only
        tok, slot = torch.nonzero((ids == e) & (weights != 0), as_tuple=True)
        w13_e, w2_e = rnd_w13(expert_dense(w13, e, h)), rnd_w2(expert_dense(w2, e, inter))  # one expert at a time
        hcat = x[tok].float() @ w13_e.t()  # [n, 2I]
        if b13 is not None:
            hcat = hcat + b13[e].float()
        ye = rnd(torch_act(hcat, activation)) @ w2_e.t()  # [n, H]
        if b2 is not None:
            ye = ye + b2[e].float()
        out.index_add_(0, tok, ye * weights[tok, slot, None].float())
    return out.to(out_dtype)
