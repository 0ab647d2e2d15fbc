"""MLA decode over the paged latent cache: split-KV latent attention and its reduce; the twin.

Shape legend: B sequences (one query token each: T == B), H query heads, C kv_lora_rank
(latent width), Dr qk_rope_head_dim, R = (num_blocks + 1) * BS pool rows, BS tokens per
block, W block-table width, S splits of one sequence's context, BH heads per program,
NH = ceil(H / BH) head blocks, BC / BDR = C / Dr padded to powers of two >= 16.
  out = latent_decode(q_lat [B, H, C], q_pe [B, H, Dr], pool, block_tables, seq_lens, scale)
  scores[h, j] = (q_lat[b, h] . c_kv[j] + q_pe[b, h] . k_pe[j]) * scale   over j < seq_lens[b]
  out[b, h]    = softmax_j(scores[h]) @ c_kv                              # [B, H, C]
The latent is shared by all heads (absorbed weights: lowbit.models.deepseek_v3), so a
program takes BH heads of one sequence and reads each c_kv / k_pe tile once for all of them:
two tensor-core products per tile, [BH, BC] x [BC, BN] (+ [BH, BDR] x [BDR, BN]) for the
scores and [BH, BN] x [BN, BC] for the context.

Memory layout read (lowbit.engine.paged_cache, one MLA layer stored as one kv head):
  pool.k    [R, 1, C]   c_kv; row r = block * BS + offset, C contiguous values
  pool.v    [R, 1, Dr]  k_pe, same rows
  k_scale, v_scale [R, 1] float32, fp8 pools only: value = fp8 code * scale (per token)
  block_tables [B, W] int32: position p of sequence b sits at row
            block_tables[b, p // BS] * BS + p % BS; entries past a sequence's end are padding.
  seq_lens  [B] int32, cached + new tokens (the step's own latent is already in the pool:
            the route writes it first through the `kv_write` op, index_copy_ at slot_mapping).

Kernels (lengths and tables come from device memory: the grid depends on host shapes only,
so a decode step can be captured in a CUDA graph and replayed at other lengths):
  _latent_split_kernel  grid (NH, B, S): the head blocks of one (sequence, split) are
      neighbours in launch order, so the latent tiles they share are read from L2 after
      the first. Split s of sequence b covers keys
      [s * chunk, min((s + 1) * chunk, len)), chunk = ceil(len / S) rounded up to BN, from
      the device length; online softmax in base 2 over float32 scores. S == 1 (DIRECT): the
      program writes the output. Otherwise it writes its partial (acc [BH, C], m, l) to
      part / ml at row (b * H + h) * S + s; splits past the end write nothing.
      S is a host constant (lowbit.kernels.attention.decode_splits: from B, NH, the SM
      count and W * BS, the table capacity, which is static under a graph) and a run-time
      argument (a wider table changes S without a recompile).
  _latent_reduce_kernel grid (B, H, ceil(C / BCR)). Merges the live splits of one head over
      BCR latent columns, RS splits a tile, with an online max: live = ceil(len / chunk),
      from the same device length and chunk formula as the split kernel, so a short context
      under a wide (graph-static) S reads only the partials that hold keys (at B = 1 and
      S = 128 over 512 keys: 16 of 128), and C is spread over several programs a head.
  _latent_reduce_uv_kernel grid (B, H, ceil(Dv / BV)) (MLA decode with W_UV given): the
      same merge, in two passes (the merged max and denominator over the live splits, then
      the context BCR columns at a time), each column block rounded to the output dtype and
      multiplied by W_UV[h]'s rows v at once: out [B, H, Dv] with no [B, H, C] round trip and
      no separate batched GEMM (which cuBLAS ran as a split-K GEMM and its reduce).
Invariants: every key tile a program visits holds at least one visible key (n0 < end), so
each row's running max is finite after it; every live split holds a key (split 0 holds
key 0: seq_lens >= 1), so the merged max and denominator are finite and > 0. Masked loads never touch pool rows past
a sequence's end (pools are torch.empty: those rows may hold anything, NaN included), and
head rows >= H load zeros and are never stored.
Twin: `reference_latent_decode` (gather each sequence's rows, lowbit.kernels.attention
.reference_latent_attention in float32).
"""

from __future__ import annotations

import torch

from lowbit.kernels import launch
from lowbit.kernels.attention import (
    FP8,
    LOG2E,
    KVPool,
    _dot,
    _gather,
    _tile_rows,
    decode_splits,
    reference_latent_attention,
)
from lowbit.kernels.runtime import interpreting, tl, triton

LATENT_CFG = dict(BH=16, BN=32, num_warps=8, num_stages=2)  # sm_90: 111 registers, no spill
REDUCE_SPLITS = 16  # RS: partials merged per tile by the reduce kernel
REDUCE_COLS = 128  # BCR: latent columns per reduce program (C = 512: 4 programs a head)
UV_ROWS = 64  # BV: W_UV rows (output values) per program of the fused reduce (Dv = 128: 2 a head)
MAX_LATENT = 1024  # C above this would not fit a program's registers (DeepSeek: 512)
MAX_ROPE_DIM = 256


@triton.jit
def _latent_split_kernel(
    ql_ptr, qp_ptr, c_ptr, p_ptr, cs_ptr, ps_ptr, bt_ptr, lens_ptr, seq_ptr, out_ptr, part_ptr, ml_ptr,
    qk_scale, S, stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_cr, stride_pr, stride_sr,
    stride_bt, stride_ot, stride_oh,
    H: tl.constexpr, C: tl.constexpr, DR: tl.constexpr, BC: tl.constexpr, BDR: tl.constexpr,
    BH: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, DIRECT: tl.constexpr,
    FP8: tl.constexpr, IEEE: tl.constexpr, HAS_SEQ: tl.constexpr,
):
    h = tl.program_id(0) * BH + tl.arange(0, BH)
    b = tl.program_id(1)
    sp = tl.program_id(2)
    hmask = h < H
    seq_len = tl.load(lens_ptr + b)
    tb = b  # the block-table row of query b: its own, or its sequence's (a prefill token)
    if HAS_SEQ:
        tb = tl.load(seq_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, S), BN) * BN
    start = sp * chunk
    end = tl.minimum(start + chunk, seq_len)
    c = tl.arange(0, BC)
    cmask = c < C
    r = tl.arange(0, BDR)
    rmask = r < DR
    qmask = hmask[:, None] & cmask[None, :]
    q = tl.load(ql_ptr + b * stride_qlt + h[:, None] * stride_qlh + c[None, :], mask=qmask, other=0.0)
    qp = tl.load(qp_ptr + b * stride_qpt + h[:, None] * stride_qph + r[None, :],
                 mask=hmask[:, None] & rmask[None, :], other=0.0)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BC], tl.float32)
    for n0 in range(start, end, BN):
        n = n0 + tl.arange(0, BN)
        nmask = n < end
        rows = _tile_rows(bt_ptr, tb, n, nmask, stride_bt, BS)
        kv = tl.load(c_ptr + rows[:, None] * stride_cr + c[None, :],
                     mask=nmask[:, None] & cmask[None, :], other=0.0)  # [BN, BC]
        pe = tl.load(p_ptr + rows[:, None] * stride_pr + r[None, :],
                     mask=nmask[:, None] & rmask[None, :], other=0.0)  # [BN, BDR]
        if FP8:
            kv = kv.to(q.dtype)
            pe = pe.to(q.dtype)
            ks = tl.load(cs_ptr + rows * stride_sr, mask=nmask, other=0.0)  # [BN]
            ps = tl.load(ps_ptr + rows * stride_sr, mask=nmask, other=0.0)
            s = _dot(q, tl.trans(kv), IEEE) * ks[None, :] + _dot(qp, tl.trans(pe), IEEE) * ps[None, :]
        else:
            s = _dot(q, tl.trans(kv), IEEE) + _dot(qp, tl.trans(pe), IEEE)  # [BH, BN] float32
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the tile holds a visible key
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8:
            p = p * ks[None, :]
        acc = acc * alpha[:, None] + _dot(p.to(kv.dtype), kv, IEEE)
        m_i = m_new
    if DIRECT:  # S == 1: split 0 holds every key, l > 0 on every row
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + b * stride_ot + h[:, None] * stride_oh + c[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=qmask)
    elif start < seq_len:  # a split past the end writes nothing: the reduce skips it
        row = (b * H + h) * S + sp  # [BH]
        tl.store(part_ptr + row[:, None] * BC + c[None, :], acc, mask=qmask)
        tl.store(ml_ptr + row * 2, m_i, mask=hmask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=hmask)


@triton.jit
def _latent_reduce_kernel(part_ptr, ml_ptr, lens_ptr, out_ptr, S, stride_ot, stride_oh,
                          H: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BCR: tl.constexpr,
                          BN: tl.constexpr, RS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, S), BN) * BN  # the split kernel's
    live = tl.cdiv(seq_len, chunk)  # splits holding keys, 1..S: the others wrote nothing
    base = (b * H + h) * S
    c = tl.program_id(2) * BCR + tl.arange(0, BCR)
    cmask = c < C
    m_run = tl.max(tl.full([RS], float("-inf"), tl.float32), 0)
    den = tl.sum(tl.zeros([RS], tl.float32), 0)
    num = tl.zeros([BCR], tl.float32)
    for s0 in range(0, live, RS):
        t = s0 + tl.arange(0, RS)
        tmask = t < live
        m_t = tl.load(ml_ptr + (base + t) * 2, mask=tmask, other=float("-inf"))
        l_t = tl.load(ml_ptr + (base + t) * 2 + 1, mask=tmask, other=0.0)
        acc = tl.load(part_ptr + (base + t)[:, None] * BC + c[None, :], mask=tmask[:, None] & cmask[None, :],
                      other=0.0)  # [RS, BCR]
        m_new = tl.maximum(m_run, tl.max(m_t, 0))  # finite: every live split holds a key
        alpha = tl.math.exp2(m_run - m_new)
        w = tl.math.exp2(m_t - m_new)  # 0 on masked rows
        den = den * alpha + tl.sum(l_t * w, 0)
        num = num * alpha + tl.sum(acc * w[:, None], 0)
        m_run = m_new
    tl.store(out_ptr + b * stride_ot + h * stride_oh + c, (num / den).to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _latent_reduce_uv_kernel(part_ptr, ml_ptr, lens_ptr, w_ptr, out_ptr, S, stride_wh, stride_wv,
                             stride_ot, stride_oh, H: tl.constexpr, C: tl.constexpr, DV: tl.constexpr,
                             BC: tl.constexpr, BCR: tl.constexpr, BV: tl.constexpr, BN: tl.constexpr,
                             RS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    v = tl.program_id(2) * BV + tl.arange(0, BV)
    vmask = v < DV
    seq_len = tl.load(lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, S), BN) * BN  # the split kernel's
    live = tl.cdiv(seq_len, chunk)
    base = (b * H + h) * S
    # pass 1: the merged max and denominator (every live split holds a key: both finite, den > 0)
    m_run = tl.max(tl.full([RS], float("-inf"), tl.float32), 0)
    den = tl.sum(tl.zeros([RS], tl.float32), 0)
    for s0 in range(0, live, RS):
        t = s0 + tl.arange(0, RS)
        tmask = t < live
        m_t = tl.load(ml_ptr + (base + t) * 2, mask=tmask, other=float("-inf"))
        l_t = tl.load(ml_ptr + (base + t) * 2 + 1, mask=tmask, other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_t, 0))
        den = den * tl.math.exp2(m_run - m_new) + tl.sum(l_t * tl.math.exp2(m_t - m_new), 0)
        m_run = m_new
    # pass 2, BCR latent columns at a time: the context, rounded to the output dtype as the
    # unfused path stores it, times W_UV's rows v of head h
    acc = tl.zeros([BV], tl.float32)
    for c0 in range(0, C, BCR):
        c = c0 + tl.arange(0, BCR)
        cmask = c < C
        num = tl.zeros([BCR], tl.float32)
        for s0 in range(0, live, RS):
            t = s0 + tl.arange(0, RS)
            tmask = t < live
            wt = tl.math.exp2(tl.load(ml_ptr + (base + t) * 2, mask=tmask, other=float("-inf")) - m_run)
            p = tl.load(part_ptr + (base + t)[:, None] * BC + c[None, :], mask=tmask[:, None] & cmask[None, :],
                        other=0.0)  # [RS, BCR]
            num += tl.sum(p * wt[:, None], 0)
        o = (num / den).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + h * stride_wh + v[:, None] * stride_wv + c[None, :],
                    mask=vmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)  # [BV, BCR]
        acc += tl.sum(w * o[None, :], 1)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + v, acc.to(out_ptr.dtype.element_ty), mask=vmask)


def _check(q_lat: torch.Tensor, q_pe: torch.Tensor, pool: KVPool, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, out: torch.Tensor | None, seq_idx: torch.Tensor | None) -> None:
    """The inputs' layout; out (the latent context's buffer) unless None (W_UV's output)."""
    B, H, C = q_lat.shape
    R = pool.k.shape[0]
    assert pool.k.shape == (R, 1, C) and pool.v.shape[:2] == (R, 1), "one latent 'head': k [R, 1, C], v [R, 1, Dr]"
    assert q_pe.shape == (B, H, pool.v.shape[-1]) and q_pe.dtype == q_lat.dtype
    assert R % pool.block_size == 0 and C <= MAX_LATENT and q_pe.shape[-1] <= MAX_ROPE_DIM
    assert q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1
    assert out is None or (out.stride(-1) == 1 and out.shape == q_lat.shape and out.dtype == q_lat.dtype)
    assert pool.k.stride(-1) == 1 and pool.v.stride(-1) == 1
    assert q_lat.dtype in (torch.bfloat16, torch.float16, torch.float32)
    assert pool.k.dtype in (q_lat.dtype, FP8) and pool.v.dtype == pool.k.dtype
    if pool.is_fp8:
        assert pool.k_scale.dtype == torch.float32 and pool.k_scale.shape == (R, 1)
        assert pool.v_scale.stride() == pool.k_scale.stride()
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (B,)
    if seq_idx is None:
        assert block_tables.shape[0] == B
    else:
        assert seq_idx.dtype == torch.int32 and seq_idx.shape == (B,) and seq_idx.device == q_lat.device


def _workspace(numel: int, device: torch.device) -> torch.Tensor:
    """The splits' partials (float32, uninitialised: only live splits are written and read)."""
    return torch.empty(numel, dtype=torch.float32, device=device)


def latent_splits(q_lat: torch.Tensor, block_size: int, block_tables: torch.Tensor,
                  config: dict | None = None) -> int:
    """S, the splits of one sequence's context latent_decode uses: from host shapes only."""
    B, H, _ = q_lat.shape
    NH = triton.cdiv(H, {**LATENT_CFG, **(config or {})}["BH"])
    return decode_splits(B, NH, block_tables.shape[1] * block_size, q_lat.device)


def latent_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, pool: KVPool, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                  num_splits: int | None = None, config: dict | None = None,
                  seq_idx: torch.Tensor | None = None, w_uv: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence: q_lat [B, H, C], q_pe [B, H, Dr] (row b = sequence b's last
    token, whose latent is already in the pool) -> latent context [B, H, C] in q_lat's dtype.
    With seq_idx [B] int32, query b reads block-table row seq_idx[b] instead of row b (the
    prefill form: latent_prefill), over its own length seq_lens[b].
    w_uv [H, Dv, C] (MLA's value up-projection, unit column stride; S > 1): the reduce
    launch also applies it, out[b, h] = W_UV[h] @ context[b, h] -> [B, H, Dv], with the
    context rounded to q_lat's dtype first, as a separate product would read it."""
    B, H, C = q_lat.shape
    if w_uv is None:
        out = torch.empty_like(q_lat) if out is None else out
    else:
        assert w_uv.shape[0] == H and w_uv.shape[2] == C and w_uv.stride(-1) == 1 and w_uv.dtype == q_lat.dtype
        out = q_lat.new_empty(B, H, w_uv.shape[1]) if out is None else out
        assert out.shape == (B, H, w_uv.shape[1]) and out.stride(-1) == 1 and out.dtype == q_lat.dtype
    _check(q_lat, q_pe, pool, block_tables, seq_lens, None if w_uv is not None else out, seq_idx)
    Dr = q_pe.shape[-1]
    cfg = {**LATENT_CFG, **(config or {})}
    BH, BC = cfg["BH"], max(16, triton.next_power_of_2(C))
    NH = triton.cdiv(H, BH)
    S = num_splits or latent_splits(q_lat, pool.block_size, block_tables, config)
    assert w_uv is None or S > 1, "the W_UV product rides in the reduce launch: S > 1"
    part = _workspace(B * H * S * BC if S > 1 else 1, q_lat.device)
    ml = _workspace(B * H * S * 2 if S > 1 else 1, q_lat.device)
    fp8 = pool.is_fp8
    cs, ps = (pool.k_scale, pool.v_scale) if fp8 else (pool.k, pool.v)  # any pointer when unused
    launch.run(
        _latent_split_kernel, (NH, B, S),
        q_lat, q_pe, pool.k, pool.v, cs, ps, block_tables, seq_lens,
        seq_lens if seq_idx is None else seq_idx, out, part, ml, scale * LOG2E, S,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), pool.k.stride(0),
        pool.v.stride(0), pool.k_scale.stride(0) if fp8 else 0, block_tables.stride(0),
        out.stride(0), out.stride(1),
        H=H, C=C, DR=Dr, BC=BC, BDR=max(16, triton.next_power_of_2(Dr)), BH=BH, BS=pool.block_size,
        BN=cfg["BN"], DIRECT=S == 1, FP8=fp8, IEEE=q_lat.dtype == torch.float32 or interpreting(),
        HAS_SEQ=seq_idx is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if w_uv is not None:
        Dv = w_uv.shape[1]
        BV = min(UV_ROWS, triton.next_power_of_2(Dv))
        launch.run(_latent_reduce_uv_kernel, (B, H, triton.cdiv(Dv, BV)), part, ml, seq_lens, w_uv, out, S,
                   w_uv.stride(0), w_uv.stride(1), out.stride(0), out.stride(1), H=H, C=C, DV=Dv, BC=BC,
                   BCR=min(BC, REDUCE_COLS), BV=BV, BN=cfg["BN"], RS=REDUCE_SPLITS, num_warps=4)
    elif S > 1:
        BCR = min(BC, REDUCE_COLS)
        launch.run(_latent_reduce_kernel, (B, H, triton.cdiv(C, BCR)), part, ml, seq_lens, out, S,
                   out.stride(0), out.stride(1), H=H, C=C, BC=BC, BCR=BCR, BN=cfg["BN"], RS=REDUCE_SPLITS,
                   num_warps=4)
    return out


def latent_prefill(q_lat: torch.Tensor, q_pe: torch.Tensor, pool: KVPool, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float,
                   out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Any step (prompts, chunks, decodes side by side): q_lat [T, H, C], q_pe [T, H, Dr]
    for the step's tokens, sequence b's at rows query_start[b]:query_start[b + 1], their
    latents already in the pool; seq_lens [B] cached + new, query_start [B + 1] int32 on the
    device. Each token is one query of the split kernel over its causal prefix: token t of
    sequence b reads row b of the tables over seq_lens[b] - query_start[b + 1] + t + 1 keys.
    The sequence of each token and its length are computed on the device (no host read, a
    grid that depends on T alone: a prefill step can be captured). Each token's program
    reads its own prefix, so a long prompt reads the latent T / 2 times on average (from L2
    where it fits) and computes with C + Dr per head and key (the absorbed form)."""
    T = q_lat.shape[0]
    assert query_start.dtype == torch.int32 and query_start.shape == (block_tables.shape[0] + 1,)
    assert seq_lens.shape == (block_tables.shape[0],)
    t = torch.arange(T, dtype=torch.int32, device=q_lat.device)
    seq = torch.searchsorted(query_start[1:], t, right=True).clamp_(max=block_tables.shape[0] - 1)
    lens = (seq_lens[seq] - query_start[seq + 1] + t + 1).to(torch.int32)
    return latent_decode(q_lat, q_pe, pool, block_tables, lens, scale, out=out, config=config,
                         seq_idx=seq.to(torch.int32))


def reference_latent_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, pool: KVPool,
                            block_tables: torch.Tensor, seq_lens: list[int], scale: float) -> torch.Tensor:
    """Twin of latent_decode, lengths read on the host: each sequence's c_kv / k_pe rows
    gathered (fp8: codes times scales, in float32), then reference_latent_attention."""
    out = torch.empty_like(q_lat)
    for b, n in enumerate(seq_lens):
        c_kv, k_pe = _gather(pool, block_tables[b], n, torch.float32)  # [n, 1, C], [n, 1, Dr]
        out[b:b + 1] = reference_latent_attention(q_lat[b:b + 1], q_pe[b:b + 1], c_kv[:, 0], k_pe[:, 0],
                                                  n - 1, scale)
    return out
