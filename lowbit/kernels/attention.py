"""Paged attention: KV write, split-KV decode, varlen prefill/extend; their torch twins.

Shape legend: T new tokens (flat, all sequences), B sequences, H query heads, Hkv kv heads,
G = H / Hkv query heads per kv head, D head dim (Dk == Dv here; MLA stays on the twin),
R = (num_blocks + 1) * BS pool rows, BS tokens per block, W block-table width,
S splits of one sequence's context (decode), GP = G padded to a power of two >= 16.

Memory layout read (lowbit.engine.paged_cache, one layer):
  k, v      [R, Hkv, D]  row r = block * BS + offset; each (row, head) is D contiguous values
  k_scale   [R, Hkv]     float32, fp8 pools only: value = fp8 code * scale (per token and head)
  block_tables [B, W] int32: position p of sequence b sits at row
            block_tables[b, p // BS] * BS + p % BS; entries past a sequence's end are padding.
  seq_lens  [B] int32, cached + new tokens; query_start [B + 1] (prefill only, int32 on device).
Token i of a sequence attends to keys j with j <= i and, with a window w, j > i - w; sinks
[H] add exp(sink_h) to each softmax denominator (gpt-oss).

Kernels (all read lengths and tables from device memory: no host value of a step enters a
launch except the grid bounds named below):
  _decode_split_kernel  grid (B, Hkv, S). One program: the G query heads of one kv head
      (so each K/V tile is read once for all of them, as a [GP, D] x [D, BN] tl.dot) over
      split s of the visible keys, online softmax in base 2. S is a host constant chosen
      from B, Hkv, the SM count and W * BS (the table width bounds every sequence length;
      under CUDA graphs W is the bucket's static width), so the grid never depends on
      lengths. Split size = ceil(visible / S) rounded up to BN, from the device length;
      splits past the end write (m = -inf, l = 0). S == 1: the program writes the output.
      S is a run-time argument (as the table width grows, S changes without a recompile).
      S > 1: each split writes its partial (acc, m, l). With FOLD it then arrives at the
      (b, kh) counter (acq_rel); the split that arrives last merges the partials of its G
      heads and the sinks (_merge_group: only the splits that hold keys, four at a time as
      one [GP, 4, BD] tile with the online rescale), writes the output and resets the
      counter: no second launch. An earlier merge read every one of the S partials head by
      head ([SP, BD] tiles; H200, Qwen3-30B-A3B decode at B = 1, S = 66: 15.7 us a layer
      against 6.3 for split + reduce). FOLD is off unless a config asks, or
      LOWBIT_DECODE_FOLD=1 for an A/B: in the engine (H100, docs/BENCHMARKS.md "Fused
      decode routes, timed") it was 1.009x at B = 1 and short context, but 0.821x (nvfp4)
      and 0.871x (bf16) at 32,768 tokens, where one program merges 66 splits in turn.
      ROPE (the rope_attention op): q_ptr is the projection's q | k | v rows; each program
      norms and rotates its G heads' q in registers (_rope_q: the rope op's math, the
      rotation partner of column d loaded beside it), and the split holding the last key
      (position seq_len - 1) first norms, rotates and stores that key and its value in pool
      row slot_mapping[b] (_rope_kv_write: the rope kernel's half-tile math and roundings,
      the same bytes), then a CTA barrier, then its tiles read that row back. No other
      program reads the row, so no grid-wide ordering is needed.
  _decode_reduce_kernel grid (B, H). Merges the S partials and the sink (FOLD off).
  _prefill_kernel       grid (ceil(T / TPB) + B, Hkv). Rows of a tile are TPB query
      tokens x G heads (row r: token r // G, head r % G), so K/V are read once per kv head;
      causal and window masks per row; keys loop from the window's start to the tile's
      last token. Program p finds its sequence and tile from the device query_start: the
      tiles of sequence b are ceil(q_len_b / TPB), numbered in sequence order (a cumulative
      sum over the B + 1 starts in each program); programs past the last tile exit. The
      bound sum_b ceil(q_len_b / TPB) <= ceil(T / TPB) + B needs only T and B, so a captured
      prefill step (lowbit.engine.prefill_graphs, T and B padded to a bucket) replays for
      any lengths that fit it.
fp8 pools (decode; prefill with config WORDS): K / V tiles load as int32 words and convert two
codes an instruction into float16 in word order (`_fp8_words`: column j * BD / 4 + w holds
head-dim index 4 w + j); q is loaded, and acc stored, through the same order (`_word_col`).
Invariants: Dk == Dv; BD = D padded to a power of two >= 16 (masked); masked loads never
touch rows past a sequence's end (pools are torch.empty: those rows may hold anything);
every live query row sees at least its own key, so its max logit is finite.
Twins: `reference_kv_write`, `reference_paged_attention` (gather rows, float32 softmax).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from lowbit.kernels import launch
from lowbit.kernels.norm_op import DTYPE_CODE, round_to
from lowbit.kernels.pdl import pdl_enter
from lowbit.kernels.runtime import (
    HAS_TRITON,
    interpreting,
    semaphore,
    sm_count,
    tl,
    triton,
)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448, as lowbit.engine.paged_cache stores
LOG2E = math.log2(math.e)
DECODE_CFG = dict(BN=64, num_warps=4, num_stages=2)
PREFILL_CFG = dict(BM=64, BN=64, num_warps=4, num_stages=2)
# fp8 pools: word tiles (WORDS) converted in registers; with num_stages 1 the codes go from
# the load to the conversion without a shared-memory stage of 8-bit elements. BN 128 was the
# fastest of the sweep at every fp8 point (H100: docs/BENCHMARKS.md "fp8 KV decode"). Prefill
# keeps the element-wise path with its pipelined loads: the word path at num_stages 1 halved
# prefill at 32,768 tokens of context (docs/KERNEL_NOTES.md).
FP8_DECODE_CFG = dict(BN=128, num_warps=4, num_stages=1)
FP8_PREFILL_CFG = dict(WORDS=False)
FOLD_ENV = "LOWBIT_DECODE_FOLD"  # "1": FOLD in every decode launch whose config does not say (A/B)
MIN_SPLIT_TOKENS = 128  # a decode split shorter than this costs more in the reduce than it saves
MAX_SPLITS = 128
SPLIT_WAVES = 2  # decode programs aimed at per SM


@dataclass
class KVPool:
    """One layer of the paged cache, flattened to rows (see the module docstring)."""

    k: torch.Tensor  # [R, Hkv, D]
    v: torch.Tensor  # [R, Hkv, D]
    block_size: int
    k_scale: torch.Tensor | None = None  # [R, Hkv] float32 (fp8 pools)
    v_scale: torch.Tensor | None = None

    @property
    def is_fp8(self) -> bool:
        return self.k.dtype == FP8


# -- KV write --------------------------------------------------------------------------------
def reference_kv_write(k: torch.Tensor, v: torch.Tensor, pool: KVPool, slot_mapping: torch.Tensor) -> None:
    """Store k/v [T, Hkv, D] at pool rows slot_mapping [T] (int64). No host read: graph-safe.
    fp8 pools: scale = amax over D / 448 per token and head, code = x / scale."""
    for x, dst, scale in ((k, pool.k, pool.k_scale), (v, pool.v, pool.v_scale)):
        if scale is None:
            dst.index_copy_(0, slot_mapping, x.to(dst.dtype))
            continue
        s = x.float().abs().amax(-1).clamp(min=1e-12) / FP8_MAX  # [T, Hkv]
        codes = (x.float() / s[..., None]).to(dst.dtype)
        dst.view(torch.uint8).index_copy_(0, slot_mapping, codes.view(torch.uint8))  # no fp8 kernel
        scale.index_copy_(0, slot_mapping, s)


# -- twins -------------------------------------------------------------------------------------
def _gather(pool: KVPool, table: torch.Tensor, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [n, Hkv, D] of positions 0..n-1 of one sequence (block table row `table`)."""
    pos = torch.arange(n, device=table.device)
    rows = table[pos // pool.block_size].long() * pool.block_size + pos % pool.block_size
    k, v = pool.k[rows].to(dtype), pool.v[rows].to(dtype)
    if pool.is_fp8:
        k = k * pool.k_scale[rows][..., None]
        v = v * pool.v_scale[rows][..., None]
    return k, v


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
                    window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """float32 [L, H, Dv]: q [L, H, Dk] at cache indices q_start.., k [S, Hkv, Dk], v [S, Hkv, Dv]."""
    L, H, _ = q.shape
    rep = H // k.shape[1]
    k = k.float().repeat_interleave(rep, dim=1)  # [S, H, Dk]: head h reads kv head h // rep
    v = v.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.float(), k) * scale  # [H, L, S]
    qi = torch.arange(q_start, q_start + L, device=q.device)[:, None]
    kj = torch.arange(k.shape[0], device=q.device)[None, :]
    visible = kj <= qi
    if window is not None:
        visible &= kj > qi - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(H, 1, 1).expand(H, L, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hls,shd->lhd", probs, v)


def reference_paged_attention(q: torch.Tensor, pool: KVPool, block_tables: torch.Tensor,
                              query_start: list[int], seq_lens: list[int], scale: float,
                              window: int | None = None, sinks: torch.Tensor | None = None,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of both kernels: q [T, H, D] -> [T, H, Dv] in q.dtype, lengths read on the host.
    Sequence b owns rows query_start[b]:query_start[b+1] of q, its last query at seq_lens[b]-1."""
    out = q.new_empty(q.shape[0], q.shape[1], pool.v.shape[-1]) if out is None else out
    for b, n in enumerate(seq_lens):
        s, e = query_start[b], query_start[b + 1]
        k, v = _gather(pool, block_tables[b], n, torch.float32)
        out[s:e] = dense_attention(q[s:e], k, v, n - (e - s), scale, window, sinks).to(out.dtype)
    return out


# -- Triton ------------------------------------------------------------------------------------
@triton.jit
def _tile_rows(bt_ptr, b, n, nmask, stride_bt, BS: tl.constexpr):
    """int64 pool rows of positions n [BN] of sequence b (0 where masked)."""
    page = tl.load(bt_ptr + b * stride_bt + n // BS, mask=nmask, other=0)
    return page.to(tl.int64) * BS + (n % BS)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in float32. IEEE: float32 operands and product (float32 models, and the
    interpreter, whose bf16 dot is wrong: the operands' values are the same)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


# Eight e4m3 codes (two int32 words of a row, pack=2) -> four float16x2: $0 = byte 0 of each
# word, $1 byte 1, $2 byte 2, $3 byte 3. One PRMT gathers a byte pair into a 16-bit half,
# one CVT (F2FP) converts two codes; e4m3 values are all exact in float16.
_E4M3_F16_PTX = ("{\n.reg .b32 x;\n.reg .b16 l, h;\n"
                 "prmt.b32 x, $4, $5, 0x5140;\nmov.b32 {l, h}, x;\n"
                 "cvt.rn.f16x2.e4m3x2 $0, l;\ncvt.rn.f16x2.e4m3x2 $1, h;\n"
                 "prmt.b32 x, $4, $5, 0x7362;\nmov.b32 {l, h}, x;\n"
                 "cvt.rn.f16x2.e4m3x2 $2, l;\ncvt.rn.f16x2.e4m3x2 $3, h;\n}")
if HAS_TRITON:
    _E4M3_F16_PTX = tl.constexpr(_E4M3_F16_PTX)


@triton.jit
def _word_col(d, BD: tl.constexpr, WORDS: tl.constexpr):
    """The head-dim index that column d of a tile holds: d itself, or with WORDS the word
    order of _fp8_words (column j * BD / 4 + w holds index 4 w + j)."""
    if WORDS:
        return 4 * (d % (BD // 4)) + d // (BD // 4)
    return d


@triton.jit
def _fp8_words(ptr, rows, kh, stride_r, stride_h, nmask, D: tl.constexpr, BD: tl.constexpr,
               ASM: tl.constexpr):
    """An fp8 K or V tile [BN, BD] as float16 in word order (_word_col): row r's int32 words
    (four codes each) load 16 bytes a thread, and byte j of word w lands in column
    j * BD / 4 + w, so that the bytes one instruction converts stay side by side. ASM: the PTX
    above; otherwise (the interpreter) the same codes loaded one by one."""
    W: tl.constexpr = BD // 4
    w = tl.arange(0, W)
    m = nmask[:, None] & (w < D // 4)[None, :]
    if ASM:
        words = ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        x = tl.load(words + rows[:, None] * (stride_r // 4) + kh * (stride_h // 4) + w[None, :], mask=m, other=0)
        o0, o1, o2, o3 = tl.inline_asm_elementwise(
            _E4M3_F16_PTX, "=r,=r,=r,=r,r,r", [x],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        base = ptr + rows[:, None] * stride_r + kh * stride_h + 4 * w[None, :]
        o0 = tl.load(base, mask=m, other=0.0).to(tl.float16)
        o1 = tl.load(base + 1, mask=m, other=0.0).to(tl.float16)
        o2 = tl.load(base + 2, mask=m, other=0.0).to(tl.float16)
        o3 = tl.load(base + 3, mask=m, other=0.0).to(tl.float16)
    j = tl.join(tl.join(o0, o1), tl.join(o2, o3))  # [BN, W, 2, 2]: byte 2 b + a at [., w, a, b]
    return tl.reshape(tl.permute(j, (0, 3, 2, 1)), (rows.shape[0], BD))


@triton.jit
def _attend(q, acc, m_i, l_i, k_ptr, v_ptr, ks_ptr, vs_ptr, rows, nmask, visible, kh, d, dmask,
            qk_scale, stride_kr, stride_kh, stride_vr, stride_vh, stride_sr,
            FP8: tl.constexpr, IEEE: tl.constexpr, WORDS: tl.constexpr = False,
            ASM: tl.constexpr = False, D: tl.constexpr = 0, BD: tl.constexpr = 0):
    """One key tile into the online softmax (base 2) of q [M, BD]; returns (acc, m, l).
    WORDS (fp8 pools): K and V come from _fp8_words as float16 in word order, q is float16
    in the same order, and acc's columns are in that order too (the caller stores them
    through _word_col); p is scaled by each key's V scale over the tile's largest one (p' <= 1
    keeps float16 from underflowing where V scales are small), and that largest scale
    multiplies p' V."""
    if WORDS:
        k = _fp8_words(k_ptr, rows, kh, stride_kr, stride_kh, nmask, D, BD, ASM)
        v = _fp8_words(v_ptr, rows, kh, stride_vr, stride_vh, nmask, D, BD, ASM)
    else:
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + rows[:, None] * stride_kr + kh * stride_kh + d[None, :], mask=kvmask, other=0.0)
        v = tl.load(v_ptr + rows[:, None] * stride_vr + kh * stride_vh + d[None, :], mask=kvmask, other=0.0)
        if FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
    s = _dot(q, tl.trans(k), IEEE)  # [M, BN] float32
    if FP8:
        s = s * tl.load(ks_ptr + rows * stride_sr + kh, mask=nmask, other=0.0)[None, :]
    s = tl.where(visible, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if WORDS:
        vs = tl.load(vs_ptr + rows * stride_sr + kh, mask=nmask, other=0.0)
        vmax = tl.max(vs, 0)  # > 0: every tile holds a key, every scale is > 0
        pv = _dot((p * (vs * (1.0 / vmax))[None, :]).to(tl.float16), v, IEEE) * vmax
    else:
        if FP8:
            p = p * tl.load(vs_ptr + rows * stride_sr + kh, mask=nmask, other=0.0)[None, :]
        pv = _dot(p.to(v.dtype), v, IEEE)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def _finish(acc, m_i, l_i, sinks_ptr, h, hmask, HAS_SINKS: tl.constexpr):
    """acc / softmax denominator, the sink's exp added to it."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_i, sink)
        keep = tl.math.exp2(m_i - m_all)
        acc = acc * keep[:, None]
        l_i = l_i * keep + tl.math.exp2(sink - m_all)
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l == 0 only on rows never stored


# -- the step's k/v into pool rows, q/k RoPE (the rope op's kernel and the ROPE decode) --
@triton.jit
def kv_fp8_scale(amax, RECIP: tl.constexpr):
    """A pool row's fp8 scale from its |x| max: max(amax, 1e-12) / 448 (reference_kv_write's).
    RECIP: as torch on CUDA divides by a host scalar, amax * float32(1 / 448); else an IEEE
    division, as torch on the CPU."""
    amax = tl.maximum(amax, 1e-12)
    if RECIP:
        return amax * (1.0 / 448.0)
    return tl.math.div_rn(amax, tl.zeros_like(amax) + 448.0)


@triton.jit
def kv_fp8_codes(x, s, ROUND: tl.constexpr = True):
    """x / s (s broadcast to x's shape) rounded to float8_e4m3. ROUND: round in float32 first
    (round_to: the interpreter truncates its fp8 casts); on the GPU (ROUND False) the store's
    conversion (cvt.rn.satfinite) rounds to nearest even itself, to the same codes, without
    the dozen instructions an element that the emulation costs."""
    q = tl.math.div_rn(x, s)
    if ROUND:
        q = round_to(q, 3)
    return q


@triton.jit
def store_pool_rows(dst_ptr, scale_ptr, x1, x2, slot, kh, j, rows, col, stride0, stride1,
                    scale_stride, HALF: tl.constexpr, IS_FP8: tl.constexpr, RECIP: tl.constexpr):
    """Pool rows (slot, kh[i]) <- the halves x1, x2 [BH, BHALF] float32 of tile rows i where
    rows[i]. fp8: codes x / s with s = kv_fp8_scale per row, stored at scale_ptr [N, Hkv]."""
    mask = rows[:, None] & col[None, :]
    if IS_FP8:
        amax = tl.maximum(tl.max(tl.abs(x1), axis=1), tl.max(tl.abs(x2), axis=1))  # [BH]
        s = kv_fp8_scale(amax, RECIP)
        s2 = s[:, None] + tl.zeros_like(x1)
        x1, x2 = kv_fp8_codes(x1, s2, not RECIP), kv_fp8_codes(x2, s2, not RECIP)
        tl.store(scale_ptr + slot * scale_stride + kh, s, mask=rows)
    dst = dst_ptr + slot * stride0 + kh[:, None] * stride1 + j[None, :]
    tl.store(dst, x1, mask=mask)
    tl.store(dst + HALF, x2, mask=mask)


@triton.jit
def qk_norm_halves(x1, x2, is_q, qw_ptr, kw_ptr, j, col, eps, HALF: tl.constexpr,
                   DT: tl.constexpr, NDT: tl.constexpr):
    """Halves x1, x2 [BH, BHALF] float32 of whole heads, RMS-normed per row with norm_op's
    roundings, times q_weight on q rows (is_q) and k_weight on the others."""
    sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [BH]
    mean_sq = tl.math.div_rn(sum_sq, tl.zeros_like(sum_sq) + 2 * HALF)
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))[:, None]  # [BH, 1]
    wq1 = tl.load(qw_ptr + j, mask=col, other=0.0).to(tl.float32)[None, :]
    wq2 = tl.load(qw_ptr + HALF + j, mask=col, other=0.0).to(tl.float32)[None, :]
    wk1 = tl.load(kw_ptr + j, mask=col, other=0.0).to(tl.float32)[None, :]
    wk2 = tl.load(kw_ptr + HALF + j, mask=col, other=0.0).to(tl.float32)[None, :]
    y1 = round_to(tl.where(is_q[:, None], wq1, wk1) * round_to(x1 * inv, DT), NDT)
    y2 = round_to(tl.where(is_q[:, None], wq2, wk2) * round_to(x2 * inv, DT), NDT)
    return y1, y2


@triton.jit
def _rope_q(qkv_ptr, b, h, dc, qmask, stride_qt, p, cs_ptr, stride_cs, qw_ptr, eps,
            D: tl.constexpr, DT: tl.constexpr, NDT: tl.constexpr, HAS_NORM: tl.constexpr):
    """q [GP, BD] float32 of heads h of token b as the rope op makes it (qk_norm_halves'
    norm, neox rotation by row p of cos_sin, rounded to DT), column j holding head-dim index
    dc[j]: each column's rotation partner (dc -+ D/2) loads beside it."""
    half: tl.constexpr = D // 2
    lo = dc < half
    partner = tl.where(lo, dc + half, dc - half)
    src = qkv_ptr + b * stride_qt + h[:, None] * D
    x = tl.load(src + dc[None, :], mask=qmask, other=0.0).to(tl.float32)
    xp = tl.load(src + partner[None, :], mask=qmask, other=0.0).to(tl.float32)
    cmask = dc < D
    if HAS_NORM:
        sum_sq = tl.sum(x * x, axis=1)  # masked columns hold 0
        mean_sq = tl.math.div_rn(sum_sq, tl.zeros_like(sum_sq) + D)
        inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))[:, None]
        w = tl.load(qw_ptr + dc, mask=cmask, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(qw_ptr + partner, mask=cmask, other=0.0).to(tl.float32)[None, :]
        x = round_to(w * round_to(x * inv, DT), NDT)
        xp = round_to(wp * round_to(xp * inv, DT), NDT)
    c = dc % half
    cos = tl.load(cs_ptr + p * stride_cs + c, mask=cmask, other=0.0)[None, :]
    sin = tl.load(cs_ptr + p * stride_cs + half + c, mask=cmask, other=0.0)[None, :]
    sgn = tl.where(lo, -1.0, 1.0)[None, :]  # x1 cos - x2 sin, x2 cos + x1 sin
    return round_to(x * cos + (sgn * xp) * sin, DT)


@triton.jit
def _rope_kv_write(qkv_ptr, b, kh, stride_qt, p, cs_ptr, stride_cs, kw_ptr, eps, slot, k_ptr,
                   v_ptr, ks_ptr, vs_ptr, stride_kr, stride_kh, stride_vr, stride_vh, stride_sr,
                   H, HKV, D: tl.constexpr, BHALF: tl.constexpr, DT: tl.constexpr,
                   NDT: tl.constexpr, HAS_NORM: tl.constexpr, FP8: tl.constexpr,
                   RECIP: tl.constexpr):
    """Pool row `slot` of kv head kh <- token b's k (normed, rotated: the rope kernel's
    half-tile math, so the same values) and v, from the q | k | v row of qkv."""
    half: tl.constexpr = D // 2
    j = tl.arange(0, BHALF)
    col = j < half
    heads = tl.full([1], 0, tl.int32) + kh  # [1]
    m = (heads >= 0)[:, None] & col[None, :]
    src = qkv_ptr + b * stride_qt + (H + heads[:, None]) * D + j[None, :]  # [1, BHALF]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=m, other=0.0).to(tl.float32)
    if HAS_NORM:
        x1, x2 = qk_norm_halves(x1, x2, heads < 0, kw_ptr, kw_ptr, j, col, eps, half, DT, NDT)
    cos = tl.load(cs_ptr + p * stride_cs + j, mask=col, other=0.0)[None, :]
    sin = tl.load(cs_ptr + p * stride_cs + half + j, mask=col, other=0.0)[None, :]
    o1 = round_to(x1 * cos - x2 * sin, DT)
    o2 = round_to(x2 * cos + x1 * sin, DT)
    v1 = tl.load(src + HKV * D, mask=m, other=0.0).to(tl.float32)
    v2 = tl.load(src + HKV * D + half, mask=m, other=0.0).to(tl.float32)
    rows = (heads >= 0) & (slot >= 0)
    store_pool_rows(k_ptr, ks_ptr, o1, o2, slot, heads, j, rows, col, stride_kr, stride_kh,
                    stride_sr, half, FP8, RECIP)
    store_pool_rows(v_ptr, vs_ptr, v1, v2, slot, heads, j, rows, col, stride_vr, stride_vh,
                    stride_sr, half, FP8, RECIP)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, sinks_ptr, out_ptr, part_ptr, ml_ptr,
    sem_ptr, qk_scale, window, S, stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_sr,
    stride_bt, stride_ot, stride_oh, pos_ptr, cs_ptr, qw_ptr, kw_ptr, slot_ptr, stride_cs, eps,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
    BN: tl.constexpr, DIRECT: tl.constexpr, FOLD: tl.constexpr,
    FP8: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, IEEE: tl.constexpr,
    WORDS: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, ROPE: tl.constexpr,
    BHALF: tl.constexpr, DT: tl.constexpr, NDT: tl.constexpr, HAS_NORM: tl.constexpr,
    RECIP: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, S), BN) * BN
    start = lo + sp * chunk
    end = tl.minimum(start + chunk, seq_len)
    g = tl.arange(0, GP)
    gmask = g < G
    h = kh * G + g
    d = tl.arange(0, BD)
    dmask = d < D
    dc = _word_col(d, BD, WORDS)  # the head-dim index of q's and acc's column d
    qmask = gmask[:, None] & (dc < D)[None, :]
    if ROPE:  # q_ptr is the q | k | v rows of the projection (stride_qh == D)
        p = tl.load(pos_ptr + b).to(tl.int64)
        q = _rope_q(q_ptr, b, h, dc, qmask, stride_qt, p, cs_ptr, stride_cs, qw_ptr, eps, D,
                    DT, NDT, HAS_NORM).to(q_ptr.dtype.element_ty)
        last = seq_len - 1
        if (start <= last) & (last < end):  # the split holding the step's key writes it first
            _rope_kv_write(q_ptr, b, kh, stride_qt, p, cs_ptr, stride_cs, kw_ptr, eps,
                           tl.load(slot_ptr + b).to(tl.int64), k_ptr, v_ptr, ks_ptr, vs_ptr,
                           stride_kr, stride_kh, stride_vr, stride_vh, stride_sr,
                           G * tl.num_programs(1), tl.num_programs(1), D, BHALF, DT, NDT,
                           HAS_NORM, FP8, RECIP)
            tl.debug_barrier()  # its own loads below read that row back
    else:
        q = tl.load(q_ptr + b * stride_qt + h[:, None] * stride_qh + dc[None, :], mask=qmask, other=0.0)
    if WORDS:
        q = q.to(tl.float16)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BD], tl.float32)
    for n0 in range(start, end, BN):
        n = n0 + tl.arange(0, BN)
        nmask = n < end
        rows = _tile_rows(bt_ptr, b, n, nmask, stride_bt, BS)
        visible = gmask[:, None] & nmask[None, :]
        acc, m_i, l_i = _attend(q, acc, m_i, l_i, k_ptr, v_ptr, ks_ptr, vs_ptr, rows, nmask, visible,
                                kh, d, dmask, qk_scale, stride_kr, stride_kh, stride_vr, stride_vh,
                                stride_sr, FP8, IEEE, WORDS, ASM, D, BD)
    if DIRECT:  # S == 1
        o = _finish(acc, m_i, l_i, sinks_ptr, h, gmask, HAS_SINKS)
        optr = out_ptr + b * stride_ot + h[:, None] * stride_oh + dc[None, :]
        tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=qmask)
    else:
        H = G * tl.num_programs(1)
        row = (b * H + h) * S + sp  # [GP] partial index (b, h, sp)
        # an empty split (past the end) writes m = -inf, l = 0 and no acc: the merge skips it
        tl.store(part_ptr + row[:, None] * BD + dc[None, :], acc, mask=qmask & (start < end))
        tl.store(ml_ptr + row * 2, m_i, mask=gmask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=gmask)
        if FOLD:  # the split that arrives last for (b, kh) merges its G heads: no reduce launch
            tl.debug_barrier()
            tile = b * tl.num_programs(1) + kh
            arrived = tl.atomic_add(sem_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == S - 1:
                live = tl.cdiv(seq_len - lo, chunk)  # splits past it wrote nothing
                _merge_group(part_ptr, ml_ptr, sinks_ptr, out_ptr, b, h, gmask, H, S, live,
                             stride_ot, stride_oh, D, BD, GP, HAS_SINKS)
                tl.atomic_xchg(sem_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_group(part_ptr, ml_ptr, sinks_ptr, out_ptr, b, h, gmask, H, S, live,
                 stride_ot, stride_oh, D: tl.constexpr, BD: tl.constexpr, GP: tl.constexpr,
                 HAS_SINKS: tl.constexpr, SC: tl.constexpr = 4):
    """out[b, h] for the G heads h [GP] of one kv head from their first `live` partials, SC
    splits a step as one [GP, SC, BD] tile with the online-softmax rescale (the partials come
    from L2: other programs wrote them)."""
    rows0 = (b * H + h) * S  # [GP]
    c = tl.arange(0, SC)
    d = tl.arange(0, BD)
    dmask = d < D
    m_i = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BD], tl.float32)
    for s0 in range(0, live, SC):
        r = rows0[:, None] + (s0 + c)[None, :]  # [GP, SC]
        msk = gmask[:, None] & ((s0 + c) < live)[None, :]
        m_s = tl.load(ml_ptr + r * 2, mask=msk, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(ml_ptr + r * 2 + 1, mask=msk, other=0.0, cache_modifier=".cg")
        p = tl.load(part_ptr + r[:, :, None] * BD + d[None, None, :],
                    mask=msk[:, :, None] & dmask[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_i, tl.max(m_s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded heads
        alpha = tl.math.exp2(m_i - m_safe)
        w = tl.math.exp2(m_s - m_safe[:, None])  # [GP, SC], 0 where masked
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * p, 1)
        den = den * alpha + tl.sum(w * l_s, 1)
        m_i = m_new
    o = _finish(acc, m_i, den, sinks_ptr, h, gmask, HAS_SINKS)
    tl.store(out_ptr + b * stride_ot + h[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _merge_head(part_ptr, ml_ptr, sinks_ptr, out_ptr, b, h, H, S, stride_ot, stride_oh,
                D: tl.constexpr, BD: tl.constexpr, SP: tl.constexpr, HAS_SINKS: tl.constexpr):
    """out[b, h] from the S partial (acc, m, l) of head h and its sink (partials read from L2:
    other programs wrote them)."""
    s = tl.arange(0, SP)
    smask = s < S
    row = (b * H + h) * S + s
    m_s = tl.load(ml_ptr + row * 2, mask=smask, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(ml_ptr + row * 2 + 1, mask=smask, other=0.0, cache_modifier=".cg")
    m_all = tl.max(m_s, 0)  # finite: split 0 always holds the last key
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    w = tl.math.exp2(m_s - m_all)  # 0 for empty splits (m = -inf)
    d = tl.arange(0, BD)
    dmask = d < D
    live = smask & (m_s > float("-inf"))  # empty splits wrote no acc
    acc = tl.load(part_ptr + row[:, None] * BD + d[None, :], mask=live[:, None] & dmask[None, :],
                  other=0.0, cache_modifier=".cg")
    num = tl.sum(acc * w[:, None], 0)  # [BD]
    den = tl.sum(l_s * w, 0)
    if HAS_SINKS:
        den += tl.math.exp2(sink - m_all)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, (num / den).to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _decode_reduce_kernel(part_ptr, ml_ptr, sinks_ptr, out_ptr, S, stride_ot, stride_oh,
                          H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, SP: tl.constexpr,
                          HAS_SINKS: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    _merge_head(part_ptr, ml_ptr, sinks_ptr, out_ptr, tl.program_id(0), tl.program_id(1), H, S,
                stride_ot, stride_oh, D, BD, SP, HAS_SINKS)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, cuq_ptr, sinks_ptr, out_ptr,
    qk_scale, window, stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_sr,
    stride_bt, stride_ot, stride_oh, B,
    G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, TPB: tl.constexpr, BB: tl.constexpr, FP8: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, IEEE: tl.constexpr,
    WORDS: tl.constexpr, ASM: tl.constexpr,
):
    p = tl.program_id(0)
    kh = tl.program_id(1)
    i = tl.arange(0, BB)
    imask = i < B
    lo_i = tl.load(cuq_ptr + i, mask=imask, other=0)
    tiles = (tl.load(cuq_ptr + i + 1, mask=imask, other=0) - lo_i + TPB - 1) // TPB  # [BB], 0 past B
    ends = tl.cumsum(tiles, 0)  # one past each sequence's last tile
    b = tl.sum((ends <= p).to(tl.int32), 0)  # the sequence whose tiles hold p (>= B: none)
    first = tl.sum(tl.where(i < b, tiles, 0), 0)
    t0 = (p - first) * TPB
    b = tl.minimum(b, B - 1)  # keeps the loads below in bounds; the test below drops the program
    q0 = tl.load(cuq_ptr + b)
    q_len = tl.load(cuq_ptr + b + 1) - q0
    if (p < tl.sum(tiles, 0)) & (t0 < q_len):
        ctx = tl.load(lens_ptr + b) - q_len  # cached tokens before this step's queries
        r = tl.arange(0, BM)
        tok = t0 + r // G
        h = kh * G + r % G
        rmask = (r < TPB * G) & (tok < q_len)
        d = tl.arange(0, BD)
        dmask = d < D
        dc = _word_col(d, BD, WORDS)
        qmask = rmask[:, None] & (dc < D)[None, :]
        qrow = (q0 + tok).to(tl.int64)
        q = tl.load(q_ptr + qrow[:, None] * stride_qt + h[:, None] * stride_qh + dc[None, :],
                    mask=qmask, other=0.0)
        if WORDS:
            q = q.to(tl.float16)
        qpos = ctx + tok  # [BM] cache index of each row's token
        hi = ctx + tl.minimum(t0 + TPB, q_len)  # one past the tile's last token
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(ctx + t0 - window + 1, 0)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, BD], tl.float32)
        for n0 in range(lo, hi, BN):
            n = n0 + tl.arange(0, BN)
            nmask = n < hi
            rows = _tile_rows(bt_ptr, b, n, nmask, stride_bt, BS)
            visible = nmask[None, :] & (n[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                visible = visible & (n[None, :] > qpos[:, None] - window)
            acc, m_i, l_i = _attend(q, acc, m_i, l_i, k_ptr, v_ptr, ks_ptr, vs_ptr, rows, nmask,
                                    visible, kh, d, dmask, qk_scale, stride_kr, stride_kh, stride_vr,
                                    stride_vh, stride_sr, FP8, IEEE, WORDS, ASM, D, BD)
        o = _finish(acc, m_i, l_i, sinks_ptr, h, rmask, HAS_SINKS)
        optr = out_ptr + qrow[:, None] * stride_ot + h[:, None] * stride_oh + dc[None, :]
        tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=qmask)


# -- launchers ---------------------------------------------------------------------------------
def decode_splits(num_seqs: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """Splits per sequence: enough programs for SPLIT_WAVES per SM, none under MIN_SPLIT_TOKENS.
    Depends on host shapes only (max_len: the block table's capacity), so graphs can fix it."""
    sms = sm_count(device.index or 0) if device.type == "cuda" else 4
    want = -(-SPLIT_WAVES * sms // (num_seqs * num_kv_heads))
    return max(1, min(want, -(-max_len // MIN_SPLIT_TOKENS), MAX_SPLITS))


def _check(q: torch.Tensor, pool: KVPool, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           out: torch.Tensor) -> tuple[int, int, int]:
    T, H, D = q.shape
    R, Hkv, Dk = pool.k.shape
    assert Dk == D and pool.v.shape == pool.k.shape, "Dk == Dv == q's head dim (MLA stays on the twin)"
    assert H % Hkv == 0 and R % pool.block_size == 0
    assert q.stride(-1) == 1 and pool.k.stride(-1) == 1 and pool.v.stride(-1) == 1 and out.stride(-1) == 1
    assert out.shape == (T, H, D) and out.dtype == q.dtype
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32)
    assert pool.k.dtype in (q.dtype, FP8) and pool.v.dtype == pool.k.dtype
    if pool.is_fp8:
        assert pool.k_scale is not None and pool.k_scale.dtype == torch.float32
        assert pool.k_scale.shape == (R, Hkv) and pool.k_scale.stride(1) == 1
        assert pool.v_scale.stride() == pool.k_scale.stride()
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (block_tables.shape[0],)
    return H, Hkv, D


def fp8_words(q: torch.Tensor, pool: KVPool) -> bool:
    """Whether an fp8 pool's tiles load as int32 words (_fp8_words): a 16-bit q, a head dim of
    whole words, and every K / V row and head starting on a word."""
    if not pool.is_fp8 or q.dtype == torch.float32 or pool.k.shape[-1] % 4:
        return False
    return all(t.data_ptr() % 4 == 0 and t.stride(0) % 4 == 0 and t.stride(1) % 4 == 0
               for t in (pool.k, pool.v))


def _common(q: torch.Tensor, pool: KVPool, scale: float, window: int | None, sinks: torch.Tensor | None,
            cfg: dict):
    ks = pool.k_scale if pool.is_fp8 else pool.k  # any pointer when unused
    vs = pool.v_scale if pool.is_fp8 else pool.v
    sr = pool.k_scale.stride(0) if pool.is_fp8 else 0
    args = (pool.k, pool.v, ks, vs)
    strides = (pool.k.stride(0), pool.k.stride(1), pool.v.stride(0), pool.v.stride(1), sr)
    flags = dict(FP8=pool.is_fp8, HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
                 IEEE=q.dtype == torch.float32 or interpreting(),
                 WORDS=bool(cfg.get("WORDS", True)) and fp8_words(q, pool), ASM=not interpreting())
    return args, strides, flags, scale * LOG2E, 0 if window is None else int(window)


def _config(base: dict, fp8_base: dict, pool: KVPool, config: dict | None) -> dict:
    """A launch config: the pool's defaults (fp8 pools: FP8_DECODE_CFG / FP8_PREFILL_CFG)
    under the caller's keys."""
    return {**base, **(fp8_base if pool.is_fp8 else {}), **(config or {})}


@dataclass
class DecodeRope:
    """The rope op's inputs for a decode launch that makes q and the step's k/v itself
    (paged_decode's `rope`): q is then the q heads of the projection rows q | k | v."""

    positions: torch.Tensor  # [B] int64
    cos_sin: torch.Tensor  # [P, D] float32 (whole-head rotary)
    q_weight: torch.Tensor | None  # [D] (qk-norm), or None
    k_weight: torch.Tensor | None
    eps: float
    slot_mapping: torch.Tensor  # [B] int64: the pool row of each sequence's new key


def paged_decode(q: torch.Tensor, pool: KVPool, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, num_splits: int | None = None,
                 config: dict | None = None, rope: DecodeRope | None = None) -> torch.Tensor:
    """One query per sequence: q [B, H, D] (row b = sequence b's last token) -> [B, H, D].
    rope: q is q_heads(qkv) [B, H, D] of the projection rows [B, (H + 2 Hkv) D], before
    norm and rotation; the split holding each sequence's last key norms, rotates and writes
    that key and its value into the pool (rope_op's math) before reading it back."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    H, Hkv, D = _check(q, pool, block_tables, seq_lens, out)
    B, G = q.shape[0], H // Hkv
    cfg = _config(DECODE_CFG, FP8_DECODE_CFG, pool, config)
    S = num_splits or decode_splits(B, Hkv, block_tables.shape[1] * pool.block_size, q.device)
    BD = max(16, triton.next_power_of_2(D))
    kv, strides, flags, qk_scale, win = _common(q, pool, scale, window, sinks, cfg)
    part = torch.empty(B * H * S * BD if S > 1 else 1, dtype=torch.float32, device=q.device)
    if interpreting():  # tests: a partial the merge reads but no split wrote shows up as NaN
        part.fill_(float("nan"))
    ml = torch.empty(B * H * S * 2 if S > 1 else 1, dtype=torch.float32, device=q.device)
    sinks_arg = sinks if sinks is not None else seq_lens
    fold = S > 1 and cfg.get("FOLD", os.environ.get(FOLD_ENV) == "1")
    sem = semaphore(q.device, B * Hkv) if fold else seq_lens
    SP = triton.next_power_of_2(S)
    rope_args, rope_flags = _rope_args(q, seq_lens, rope)
    launch.run(_decode_split_kernel, (B, Hkv, S),
        q, *kv, block_tables, seq_lens, sinks_arg, out, part, ml, sem, qk_scale, win, S,
        q.stride(0), q.stride(1), *strides, block_tables.stride(0), out.stride(0), out.stride(1),
        *rope_args, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BD=BD, BS=pool.block_size,
        BN=cfg["BN"], DIRECT=S == 1, FOLD=fold, **flags, **rope_flags,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch.pdl_args(q))
    if S > 1 and not fold:
        launch.run(_decode_reduce_kernel, (B, H), part, ml, sinks_arg, out, S, out.stride(0),
                   out.stride(1), H=H, D=D, BD=BD, SP=SP, HAS_SINKS=sinks is not None, num_warps=4,
                   **launch.pdl_args(q))
    return out


def _rope_args(q: torch.Tensor, seq_lens: torch.Tensor, rope: DecodeRope | None) -> tuple[tuple, dict]:
    """The split kernel's ROPE arguments: (pos, cos_sin, q_weight, k_weight, slots, cos_sin
    row stride, eps) and its flags; unused pointers (seq_lens) without rope."""
    if rope is None:
        return (seq_lens,) * 5 + (0, 0.0), dict(ROPE=False, BHALF=1, DT=0, NDT=0, HAS_NORM=False,
                                               RECIP=False)
    D = q.shape[-1]
    assert q.stride(1) == D and rope.cos_sin.shape[-1] == D and rope.cos_sin.stride(-1) == 1
    norm = rope.q_weight is not None
    qw = rope.q_weight if norm else q
    kw = rope.k_weight if norm else q
    ndt = torch.promote_types(qw.dtype, q.dtype) if norm else q.dtype
    return ((rope.positions, rope.cos_sin, qw, kw, rope.slot_mapping, rope.cos_sin.stride(0), rope.eps),
            dict(ROPE=True, BHALF=triton.next_power_of_2(D // 2), DT=DTYPE_CODE[q.dtype],
                 NDT=DTYPE_CODE[ndt], HAS_NORM=norm, RECIP=q.is_cuda))


def paged_prefill(q: torch.Tensor, pool: KVPool, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start: torch.Tensor, scale: float, window: int | None = None,
                  sinks: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """Varlen queries over each sequence's cached prefix: q [T, H, D] -> [T, H, D].
    query_start [B + 1] int32 on the device, query_start[B] <= T; rows past it are not
    written. The grid depends on T and B only (no host length)."""
    out = torch.empty_like(q) if out is None else out
    H, Hkv, D = _check(q, pool, block_tables, seq_lens, out)
    assert query_start.dtype == torch.int32 and query_start.shape == (block_tables.shape[0] + 1,)
    G = H // Hkv
    cfg = _config(PREFILL_CFG, FP8_PREFILL_CFG, pool, config)
    BM = max(cfg["BM"], 16, triton.next_power_of_2(G))
    TPB = BM // G
    kv, strides, flags, qk_scale, win = _common(q, pool, scale, window, sinks, cfg)
    B = block_tables.shape[0]
    grid = (triton.cdiv(q.shape[0], TPB) + B, Hkv)
    launch.run(_prefill_kernel, grid,
        q, *kv, block_tables, seq_lens, query_start, sinks if sinks is not None else seq_lens, out,
        qk_scale, win, q.stride(0), q.stride(1), *strides, block_tables.stride(0), out.stride(0),
        out.stride(1), B, G=G, D=D, BD=max(16, triton.next_power_of_2(D)), BS=pool.block_size, BM=BM,
        BN=cfg["BN"], TPB=TPB, BB=triton.next_power_of_2(B + 1), **flags, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return out


# -- MLA ------------------------------------------------------------------------------------
def reference_latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                               k_pe: torch.Tensor, q_start: int, scale: float) -> torch.Tensor:
    """q_lat [L, H, C], q_pe [L, H, Dr] at cache indices q_start..; c_kv [S, C], k_pe [S, Dr]
    -> latent context [L, H, C] in q_lat's dtype (float32 scores and softmax)."""
    L, S = q_lat.shape[0], c_kv.shape[0]
    kv = c_kv.float()
    scores = torch.einsum("lhc,sc->hls", q_lat.float(), kv)  # [H, L, S]
    scores = (scores + torch.einsum("lhr,sr->hls", q_pe.float(), k_pe.float())) * scale
    qi = torch.arange(q_start, q_start + L, device=q_lat.device)[:, None]
    kj = torch.arange(S, device=q_lat.device)[None, :]
    probs = torch.softmax(scores.masked_fill(kj > qi, float("-inf")), dim=-1)
    return torch.einsum("hls,sc->lhc", probs, kv).to(q_lat.dtype)
