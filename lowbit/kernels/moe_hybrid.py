"""Hybrid expert layouts: experts of two LUT formats (and shared experts) in one MoE launch.

Shape legend: T tokens, H hidden, I expert width, E experts of the layer (routed, then
shared), Eg experts of group g, A top-k, S slots (T * A, shared slots included), BM slot
rows per tile, BN output columns, BK reduction step.

Layout (`HybridExperts`): one or two groups, each a stacked LUT weight pair
  w13 [Eg, 2I, H] (gate rows, then up rows) and w2 [Eg, H, I] of one format
  (docs/FORMATS.md, the LUT view), with a per-expert float32 global scale
  g13 [Eg, 2] (gate half, up half) and g2 [Eg, 2] (both columns equal); the LUT views'
  own global_scale is not read. A device descriptor maps a layer expert to its place:
  expert_group int32 [E] (0 or 1) and expert_local int32 [E] (index in that group's stack).
Typical uses: hot experts nvfp4 in group 0 and cold experts nf3 in group 1 (quantize-on-load
policy: lowbit.quantize.policy.HybridSpec); routed experts in group 0 and DeepSeek-style
shared experts in group 1, selected by extra slots of weight 1.0 (`with_shared_slots`).

Kernels: the FC1 + SiLU-gate and FC2 launches of lowbit.kernels.moe with the same program
to (expert, slots) mapping (`_tile_slots`, decode or grouped), plus one scalar branch per
program on expert_group[e]: both groups' decode paths are compiled into the kernel and a
program runs the one of its expert. No host read (CUDA-graph safe). Invariant: within a
program every slot belongs to one expert, so the branch is uniform across the program.
Reference twin: `reference_hybrid` (decode of the experts used, float32).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lowbit.formats.base import lut_view_decode
from lowbit.formats.views import LutWeight
from lowbit.kernels import launch
from lowbit.kernels.decode import (
    dot_tile,
    dot_tile_post,
    e2m1_bf16,
    exact_tiles,
    weight_args,
)
from lowbit.kernels.moe import (
    MODE_DECODE,
    MODE_GROUPED,
    _expert_rows,
    _tile_slots,
)
from lowbit.kernels.moe_layout import HybridExperts
from lowbit.kernels.moe_slots import combine_slots, flat_slots, sort_by_expert
from lowbit.kernels.runtime import (
    interpreting,
    round_for_dot,
    tl,
    triton,
)


# -- kernels ---------------------------------------------------------------------------
@triton.jit
def _acc_rows(acc, a_ptr, sl_row, valid, K, e, rows, rmask, g, codes_ptr, table_ptr, tidx_ptr,
              ab_ptr, scales_ptr, offs_ptr, KC, sce, scn, ste, sse, ssn, soe, son,
              BITS: tl.constexpr, DECODE: tl.constexpr, SK: tl.constexpr, B: tl.constexpr,
              HAS_TIDX: tl.constexpr, HAS_AB: tl.constexpr, HAS_OFFS: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr,
              E2M1_BF16: tl.constexpr, ASM: tl.constexpr):
    """acc [BM, BN] += a[sl_row, :K] @ W_e[rows, :K]^T, W decoded with global scale g
    (E2M1_BF16: exact bf16 tiles, alpha * g on the partial sum, as in moe.py)."""
    r = _expert_rows(e, rows, rmask, tidx_ptr, ab_ptr, sce, scn, ste, sse, ssn, soe, son,
                     BITS, 1, HAS_TIDX, HAS_AB, BN)
    part = tl.zeros(acc.shape, tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        at = tl.load(a_ptr + sl_row[:, None] + kk[None, :], mask=valid[:, None] & (kk < K)[None, :],
                     other=0)
        w = dot_tile(codes_ptr, table_ptr, scales_ptr, offs_ptr, r[0], r[3], r[4], r[5], r[1],
                     r[2], rmask, k0, KC, g, BN, BK, BITS, DECODE, SK, B, HAS_AB, HAS_OFFS,
                     E2M1_BF16, ASM)
        if DOT_F32:
            part = tl.dot(at.to(tl.bfloat16).to(tl.float32), tl.trans(w.to(tl.bfloat16).to(tl.float32)),
                          part, input_precision="ieee")
        else:
            part = tl.dot(at.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), part)
    part = dot_tile_post(part, r[4], g, E2M1_BF16)
    return acc + part


@triton.jit
def _hybrid_fc_kernel(
    a_ptr, out_ptr, tw_ptr, ids_ptr, order_ptr, tile_end_ptr, seg_start_ptr, counts_ptr,
    grp_ptr, loc_ptr, S, E, K, N, A, stride_at,
    ga_ptr, ca_ptr, ta_ptr, ia_ptr, aba_ptr, sa_ptr, oa_ptr, KCA, sce_a, scn_a, ste_a, sse_a,
    ssn_a, soe_a, son_a,
    gb_ptr, cb_ptr, tb_ptr, ib_ptr, abb_ptr, sb_ptr, ob_ptr, KCB, sce_b, scn_b, ste_b, sse_b,
    ssn_b, soe_b, son_b,
    BITS_A: tl.constexpr, DECODE_A: tl.constexpr, SK_A: tl.constexpr, B_A: tl.constexpr,
    HAS_TIDX_A: tl.constexpr, HAS_AB_A: tl.constexpr, HAS_OFFS_A: tl.constexpr,
    BITS_B: tl.constexpr, DECODE_B: tl.constexpr, SK_B: tl.constexpr, B_B: tl.constexpr,
    HAS_TIDX_B: tl.constexpr, HAS_AB_B: tl.constexpr, HAS_OFFS_B: tl.constexpr,
    E2M1_A: tl.constexpr, E2M1_B: tl.constexpr, ASM: tl.constexpr, FC1: tl.constexpr, MODE: tl.constexpr, SP: tl.constexpr, EP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr,
):
    """FC1 (FC1=True): out = h [S, N=I], h[s] = SiLU(a[t] Wg^T) * (a[t] Wu^T), a = x rows of
    tokens t = s // A. FC2: out = ys [S, N=H], ys[s] = tw[s] * (a[s] W2^T), a = h."""
    e, slots, valid, live = _tile_slots(ids_ptr, order_ptr, tile_end_ptr, seg_start_ptr,
                                        counts_ptr, S, E, tl.program_id(0), MODE, SP, EP, BM)
    if live:
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cmask = cols < N
        sl = slots.to(tl.int64)
        if FC1:
            arow = (slots // A).to(tl.int64) * stride_at
        else:
            arow = sl * stride_at
        grp = tl.load(grp_ptr + e)
        le = tl.load(loc_ptr + e)
        acc = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        if grp == 0:
            acc = _acc_rows(acc, a_ptr, arow, valid, K, le, cols, cmask, tl.load(ga_ptr + 2 * le),
                            ca_ptr, ta_ptr, ia_ptr, aba_ptr, sa_ptr, oa_ptr, KCA, sce_a, scn_a,
                            ste_a, sse_a, ssn_a, soe_a, son_a, BITS_A, DECODE_A, SK_A, B_A,
                            HAS_TIDX_A, HAS_AB_A, HAS_OFFS_A, BN, BK, DOT_F32, E2M1_A, ASM)
            if FC1:
                acc_u = _acc_rows(acc_u, a_ptr, arow, valid, K, le, cols + N, cmask,
                                  tl.load(ga_ptr + 2 * le + 1), ca_ptr, ta_ptr, ia_ptr, aba_ptr,
                                  sa_ptr, oa_ptr, KCA, sce_a, scn_a, ste_a, sse_a, ssn_a, soe_a,
                                  son_a, BITS_A, DECODE_A, SK_A, B_A, HAS_TIDX_A, HAS_AB_A,
                                  HAS_OFFS_A, BN, BK, DOT_F32, E2M1_A, ASM)
        else:
            acc = _acc_rows(acc, a_ptr, arow, valid, K, le, cols, cmask, tl.load(gb_ptr + 2 * le),
                            cb_ptr, tb_ptr, ib_ptr, abb_ptr, sb_ptr, ob_ptr, KCB, sce_b, scn_b,
                            ste_b, sse_b, ssn_b, soe_b, son_b, BITS_B, DECODE_B, SK_B, B_B,
                            HAS_TIDX_B, HAS_AB_B, HAS_OFFS_B, BN, BK, DOT_F32, E2M1_B, ASM)
            if FC1:
                acc_u = _acc_rows(acc_u, a_ptr, arow, valid, K, le, cols + N, cmask,
                                  tl.load(gb_ptr + 2 * le + 1), cb_ptr, tb_ptr, ib_ptr, abb_ptr,
                                  sb_ptr, ob_ptr, KCB, sce_b, scn_b, ste_b, sse_b, ssn_b, soe_b,
                                  son_b, BITS_B, DECODE_B, SK_B, B_B, HAS_TIDX_B, HAS_AB_B,
                                  HAS_OFFS_B, BN, BK, DOT_F32, E2M1_B, ASM)
        if FC1:
            ez = tl.exp(-tl.abs(acc))  # SiLU without overflow
            val = acc * tl.where(acc >= 0, 1.0 / (1.0 + ez), ez / (1.0 + ez)) * acc_u
        else:
            val = acc * tl.load(tw_ptr + sl, mask=valid, other=0)[:, None]
        tl.store(out_ptr + sl[:, None] * N + cols[None, :], val, mask=valid[:, None] & cmask[None, :])


def _group_args(w: LutWeight, g: torch.Tensor, suffix: str) -> tuple[list, dict]:
    a = weight_args(w)
    args = [g, a.codes, a.table, a.tidx, a.ab, a.scales, a.offs, a.kc, a.stride_ce, a.stride_cn,
            a.stride_te, a.stride_se, a.stride_sn, a.stride_oe, a.stride_on]
    consts = {f"BITS_{suffix}": a.bits, f"DECODE_{suffix}": a.decode, f"SK_{suffix}": a.scale_kind,
              f"B_{suffix}": a.block, f"HAS_TIDX_{suffix}": a.has_tidx,
              f"HAS_AB_{suffix}": a.has_ab, f"HAS_OFFS_{suffix}": a.has_offs,
              f"E2M1_{suffix}": e2m1_bf16(a)}
    return args, consts


def _pair_args(experts: HybridExperts, fc1: bool) -> tuple[list, dict]:
    gs = experts.groups if len(experts.groups) == 2 else experts.groups * 2
    args, consts = [], {}
    for grp, suffix in zip(gs, "AB"):
        a, c = _group_args(grp.w13 if fc1 else grp.w2, grp.g13 if fc1 else grp.g2, suffix)
        args += a
        consts.update(c)
    return args, consts


def fused_moe_hybrid(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     experts: HybridExperts, mode: str = "decode", config: dict | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, H] in x.dtype (or out's float32) over a hybrid layout; ids index the layer's
    experts (shared ones included). mode "decode" (S <= 256) or "grouped" (any T)."""
    t, h = x.shape
    a_top = ids.shape[1]
    s, e, inter = t * a_top, experts.num_experts, experts.inter
    assert h == experts.hidden, (h, experts.hidden)
    fmt = "+".join(experts.formats())
    cfg = {**launch.lookup(f"moe_hybrid_{mode}", fmt, e, h, t), **(config or {})}
    x, ids_flat, tw = flat_slots(x, ids, weights)
    if mode == "decode":
        assert s <= 256, "the decode mapping takes at most 256 slots"
        bm, tiles = max(16, triton.next_power_of_2(t)), min(e, s)
        order = tile_end = seg_start = counts = ids_flat
        mode_id = MODE_DECODE
    else:
        bm = cfg["BM"]
        order, tile_end, seg_start, counts, tiles = sort_by_expert(ids_flat, e, bm)
        mode_id = MODE_GROUPED
    common = dict(MODE=mode_id, SP=max(16, triton.next_power_of_2(s)),
                  EP=max(16, triton.next_power_of_2(e)), BM=bm, DOT_F32=interpreting(),
                  ASM=not interpreting(),
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    route = (ids_flat, order, tile_end, seg_start, counts, experts.expert_group, experts.expert_local)
    hbuf = torch.empty(s, inter, dtype=torch.float32, device=x.device)
    ys = torch.empty(s, h, dtype=torch.float32, device=x.device)
    a1, c1 = _pair_args(experts, True)
    launch.run(_hybrid_fc_kernel, (tiles, triton.cdiv(inter, cfg["BN1"])), x, hbuf, tw, *route,
               s, e, h, inter, a_top, x.stride(0), *a1, **c1, FC1=True, BN=cfg["BN1"],
               BK=cfg["BK1"], **common)
    a2, c2 = _pair_args(experts, False)
    launch.run(_hybrid_fc_kernel, (tiles, triton.cdiv(h, cfg["BN2"])), hbuf, ys, tw, *route,
               s, e, inter, h, a_top, inter, *a2, **c2, FC1=False, BN=cfg["BN2"],
               BK=cfg["BK2"], **common)
    return combine_slots(ys, x, a_top, ids_flat, e, out)


def _expert_dense(w: LutWeight, g: torch.Tensor, le: int, k: int) -> torch.Tensor:
    """float32 [N, k] of expert le: rows of the first half with g[le, 0], the rest g[le, 1]."""
    v = w.view
    one = replace(v, codes=v.codes[le], scales=v.scales[le],
                  table_index=None if v.table_index is None else v.table_index[le],
                  offsets=None if v.offsets is None else v.offsets[le])
    half = v.codes.shape[-2] // 2
    g0, g1 = (float(z) for z in g[le].tolist())
    top = lut_view_decode(replace(one, global_scale=g0))[:half, :k]
    bottom = lut_view_decode(replace(one, global_scale=g1))[half:, :k]
    return torch.cat([top, bottom])


def reference_hybrid(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     experts: HybridExperts, dot_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch twin: per expert used (host read), its group's decode, gated MLP in float32."""
    h, inter = experts.hidden, experts.inter
    rnd = (lambda t: t) if dot_dtype is None else (lambda t: round_for_dot(t, dot_dtype))
    xf = rnd(x.float())
    out = torch.zeros(x.shape[0], h, dtype=torch.float32, device=x.device)
    grp, loc = experts.expert_group.tolist(), experts.expert_local.tolist()
    for e in torch.unique(ids).tolist():
        group = experts.groups[grp[e]]
        d13 = _expert_dense(group.w13, group.g13, loc[e], h)
        d2 = _expert_dense(group.w2, group.g2, loc[e], inter)
        d13 = d13 if exact_tiles(group.w13) else rnd(d13)  # exact bf16 tiles: no rounding
        d2 = d2 if exact_tiles(group.w2) else rnd(d2)
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        hc = xf[tok] @ d13.t()
        act = torch.nn.functional.silu(hc[:, :inter]) * hc[:, inter:]
        out.index_add_(0, tok, (rnd(act) @ d2.t()) * weights[tok, slot, None].float())
    return out.to(x.dtype)
