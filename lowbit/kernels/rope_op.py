"""The `rope` op of a GQA layer: q/k RMSNorm, RoPE and the KV-cache write, in one door.

Shape legend: T tokens, H query heads, Hkv kv heads, Dh head dim, R rotary dims (R == Dh in
the Triton route), P table positions, N pool rows.
  qk_norm_rope(RopeCall) -> q [T, H, Dh], k [T, Hkv, Dh], v [T, Hkv, Dh], fresh, in qkv.dtype
    qkv [T, (H + 2 Hkv) Dh]   the merged projection: q heads, then k heads, then v heads
    q, k = rms_norm(q, q_weight), rms_norm(k, k_weight) per head (norm_op's convention),
           skipped when the weights are None (Mixtral, gpt-oss)
    q, k = rotate(q), rotate(k): "neox" pairs (i, i + R/2) of the first R dims, in float32
           from the (normed) values, rounded to qkv.dtype once;
           cos, sin = cos_sin[positions, :R/2], cos_sin[positions, R/2:]
    pool.k[slot_mapping], pool.v[slot_mapping] = k, v when a pool is given, as
           attention.reference_kv_write stores them (fp8 pools: codes x / s and scales
           s = amax / 448 per token and head)
  rope_cos_sin(inv_freq [R/2], scaling, P) -> cos_sin [P, R] float32: cos * scaling, then
    sin * scaling, the values RotaryEmbedding.forward gives for positions 0..P-1.

Routes, in selection order:
  triton_qk_norm_rope  one launch for q, k, v and the KV write (bf16 / fp16 / float32 pools of
                       qkv's dtype, or fp8); graph-safe: positions and slots are read from
                       device memory, the launch depends on shapes only
  torch                reference: split, norm (norm_op's torch math), rotate, then the kv_write
                       op (admits every call, partial rotary included)

Kernel `_qk_norm_rope_kernel`, grid (T, ceil((H + Hkv) / BH)). Program (t, b) takes BH of the
H + Hkv q-then-k heads of token t as a [BH, Dh/2] tile per half: in qkv those heads are
contiguous, head h at columns h * Dh, so one pointer formula serves q and k; row h < H is
a q head, else k head h - H, which also carries v head h - H (Hkv * Dh further on).
Memory layout: qkv rows of unit element stride (any row stride); cos_sin [P, Dh] float32 rows
of unit stride; pool.k/.v [N, Hkv, Dh] with unit stride over Dh, k_scale/v_scale [N, Hkv]
float32 rows of unit stride (fp8); q/k/v written contiguous.
Invariants: Dh even, Dh/2 padded to a power of two (masked lanes read 0, which the sums of
squares and the amax ignore); positions < P; a slot < 0 writes nothing (the torch route's
index_copy_ rejects it). The kernel reproduces the torch route's roundings (norm_op.round_to):
the normed value to qkv.dtype, the product with the weight to the weight's promoted dtype,
the rotated value to qkv.dtype, fp8 scales and codes as torch divides on the device at hand
(a host-scalar divisor becomes a reciprocal multiply on CUDA); it differs
only where the fp32 sum of squares, summed in another order, or a GPU-fused multiply-add
moves a value across a rounding boundary. Its norm and pool-write helpers (qk_norm_halves,
store_pool_rows, kv_fp8_scale / kv_fp8_codes) live in lowbit.kernels.attention: the decode
kernel's ROPE mode (the rope_attention op) writes the step's key with the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowbit.kernels import attention_op, launch, routes
from lowbit.kernels.attention import FP8, qk_norm_halves, store_pool_rows
from lowbit.kernels.norm_op import DTYPE_CODE, FLOAT_DTYPES, rms_norm_reference, round_to
from lowbit.kernels.pdl import pdl_enter
from lowbit.kernels.runtime import capability, tl, triton, triton_refusal

RECORD = "docs/BENCHMARKS.md#decode-graph"
MAX_HEAD_DIM = 256
TILE_ELEMS = 2048  # elements of one program's [BH, Dh] tile


@dataclass
class RopeCall:
    qkv: torch.Tensor  # [T, (H + 2 Hkv) Dh]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    positions: torch.Tensor  # [T] int64
    cos_sin: torch.Tensor  # [P, R] float32
    q_weight: torch.Tensor | None = None  # [Dh]
    k_weight: torch.Tensor | None = None  # [Dh]
    eps: float = 1e-6
    pool: object = None  # lowbit.kernels.attention.KVPool: k, v [N, Hkv, Dh]
    slot_mapping: torch.Tensor | None = None  # [T] int64
    forced: bool = False
    layer: str = field(default="", repr=False)  # the caller, for the kv_write counters


def rope_cos_sin(inv_freq: torch.Tensor, attention_scaling: float, max_positions: int,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """[P, R] float32: cos then sin of positions 0..P-1 times inv_freq [R/2], times scaling
    (the elementwise ops of lowbit.layers.rope.RotaryEmbedding.forward, so equal values)."""
    device = inv_freq.device if device is None else device
    positions = torch.arange(max_positions, device=device)
    freqs = positions.float()[:, None] * inv_freq.to(device)[None, :]  # [P, R/2]
    return torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)


# -- torch reference ---------------------------------------------------------------------------
def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, R] rotated pairwise (i, i + R/2) by cos, sin [T, R/2]; float32 math, x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def _rotate_head(x: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, n, Dh] with its first R dims rotated by cos_sin [T, R], in dtype."""
    R = cos_sin.shape[-1]
    cos, sin = cos_sin[:, : R // 2], cos_sin[:, R // 2 :]
    out = torch.cat((rotate_neox(x[..., :R], cos, sin), x[..., R:]), dim=-1)
    return out.to(dtype)


def _run_torch(call: RopeCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    H, Hkv, Dh, qkv = call.num_heads, call.num_kv_heads, call.head_dim, call.qkv
    q, k, v = qkv.view(qkv.shape[0], H + 2 * Hkv, Dh).split([H, Hkv, Hkv], dim=1)
    if call.q_weight is not None:
        q = rms_norm_reference(q, call.q_weight, call.eps)
        k = rms_norm_reference(k, call.k_weight, call.eps)
    cs = call.cos_sin[call.positions]  # [T, R]
    q, k = _rotate_head(q, cs, qkv.dtype), _rotate_head(k, cs, qkv.dtype)
    v = v.clone(memory_format=torch.contiguous_format)
    if call.pool is not None:
        attention_op.kv_write(k, v, call.pool, call.slot_mapping, layer=call.layer)
    return q, k, v


# -- Triton --------------------------------------------------------------------------------------
@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, v_ptr,
                         pk_ptr, pv_ptr, ks_ptr, vs_ptr, slot_ptr, stride_qkv, stride_cs,
                         stride_pk0, stride_pk1, stride_pv0, stride_pv1, stride_ks, stride_vs, eps,
                         H: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr, BHALF: tl.constexpr,
                         BH: tl.constexpr, DT: tl.constexpr, NDT: tl.constexpr,
                         HAS_NORM: tl.constexpr, HAS_POOL: tl.constexpr, IS_FP8: tl.constexpr,
                         RECIP: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)  # [BH] q heads, then k heads
    j = tl.arange(0, BHALF)
    half: tl.constexpr = DH // 2
    col = j < half
    is_q = heads < H
    is_k = (heads >= H) & (heads < H + HKV)
    live = (is_q | is_k)[:, None] & col[None, :]
    src = qkv_ptr + t * stride_qkv + heads[:, None] * DH + j[None, :]  # [BH, BHALF]
    x1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=live, other=0.0).to(tl.float32)
    if HAS_NORM:
        x1, x2 = qk_norm_halves(x1, x2, is_q, qw_ptr, kw_ptr, j, col, eps, half, DT, NDT)
    p = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + p * stride_cs + j, mask=col, other=0.0)[None, :]
    sin = tl.load(cs_ptr + p * stride_cs + half + j, mask=col, other=0.0)[None, :]
    o1 = round_to(x1 * cos - x2 * sin, DT)
    o2 = round_to(x2 * cos + x1 * sin, DT)
    q_dst = q_ptr + (t * H + heads[:, None]) * DH + j[None, :]
    q_mask = is_q[:, None] & col[None, :]
    tl.store(q_dst, o1, mask=q_mask)
    tl.store(q_dst + half, o2, mask=q_mask)
    if (tl.program_id(1) + 1) * BH > H:  # the tile holds k heads: k, v and their pool rows
        kh = heads - H  # [BH] kv head of a k row
        k_mask = is_k[:, None] & col[None, :]
        v1 = tl.load(src + HKV * DH, mask=k_mask, other=0.0).to(tl.float32)
        v2 = tl.load(src + HKV * DH + half, mask=k_mask, other=0.0).to(tl.float32)
        kv_off = (t * HKV + kh[:, None]) * DH + j[None, :]
        tl.store(k_ptr + kv_off, o1, mask=k_mask)
        tl.store(k_ptr + kv_off + half, o2, mask=k_mask)
        tl.store(v_ptr + kv_off, v1, mask=k_mask)
        tl.store(v_ptr + kv_off + half, v2, mask=k_mask)
        if HAS_POOL:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            rows = is_k & (slot >= 0)
            store_pool_rows(pk_ptr, ks_ptr, o1, o2, slot, kh, j, rows, col, stride_pk0,
                            stride_pk1, stride_ks, half, IS_FP8, RECIP)
            store_pool_rows(pv_ptr, vs_ptr, v1, v2, slot, kh, j, rows, col, stride_pv0,
                            stride_pv1, stride_vs, half, IS_FP8, RECIP)


def _shape_refusal(call: RopeCall) -> str | None:
    qkv, Dh = call.qkv, call.head_dim
    if qkv.dtype not in FLOAT_DTYPES:
        return f"qkv is {qkv.dtype} (the kernel takes bf16, fp16 or float32)"
    if qkv.dim() != 2 or qkv.stride(-1) != 1:
        return f"qkv rows are not contiguous (shape {tuple(qkv.shape)}, strides {qkv.stride()})"
    if Dh % 2 or Dh > MAX_HEAD_DIM:
        return f"head dim {Dh} is odd or > {MAX_HEAD_DIM}"
    cs = call.cos_sin
    if cs.dim() != 2 or cs.shape[-1] != Dh:
        return f"partial rotary (cos_sin {tuple(cs.shape)} for head dim {Dh}) is not supported"
    if cs.dtype != torch.float32 or cs.stride(-1) != 1:
        return f"cos_sin is {cs.dtype} with strides {cs.stride()} (float32 rows of unit stride)"
    return None


def _weight_refusal(call: RopeCall) -> str | None:
    for name, w in (("q_weight", call.q_weight), ("k_weight", call.k_weight)):
        if w is None:
            continue
        if w.dtype not in FLOAT_DTYPES or tuple(w.shape) != (call.head_dim,) or w.stride(0) != 1:
            return f"{name} is {w.dtype} {tuple(w.shape)} (one contiguous float per head dim)"
    if call.q_weight is not None and call.q_weight.dtype != call.k_weight.dtype:
        return f"q_weight is {call.q_weight.dtype}, k_weight is {call.k_weight.dtype}"
    return None


def _pool_refusal(call: RopeCall) -> str | None:
    pool = call.pool
    if pool is None:
        return None
    if pool.is_fp8:
        reason = _fp8_refusal(call)
        if reason is not None:
            return reason
    for name, t in (("k", pool.k), ("v", pool.v)):
        if t.dtype not in (call.qkv.dtype, FP8) or t.dtype != pool.k.dtype:
            return f"KV pool is {t.dtype}, qkv is {call.qkv.dtype}"
        if tuple(t.shape[1:]) != (call.num_kv_heads, call.head_dim) or t.stride(-1) != 1:
            want = f"[rows, {call.num_kv_heads}, {call.head_dim}]"
            return f"pool.{name} {tuple(t.shape)} is not {want} with unit stride over Dh"
    return None


def _fp8_refusal(call: RopeCall) -> str | None:
    pool, qkv = call.pool, call.qkv
    if qkv.is_cuda and capability(qkv.device.index or 0) < (8, 9):
        return "fp8 KV needs compute capability 8.9 or newer"
    for name, s in (("k_scale", pool.k_scale), ("v_scale", pool.v_scale)):
        if s is None or s.dtype != torch.float32 or s.dim() != 2 or s.stride(-1) != 1:
            return f"fp8 pool's {name} is not float32 [rows, {call.num_kv_heads}] of unit stride"
    return None


def _admit_triton(call: RopeCall) -> str | None:
    reason = triton_refusal(call.qkv, call.forced)
    for check in (_shape_refusal, _weight_refusal, _pool_refusal):
        reason = reason or check(call)
    return reason


def _run_triton(call: RopeCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qkv, H, Hkv, Dh = call.qkv, call.num_heads, call.num_kv_heads, call.head_dim
    T = qkv.shape[0]
    q = torch.empty(T, H, Dh, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(T, Hkv, Dh, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty(T, Hkv, Dh, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q, k, v
    bhalf = triton.next_power_of_2(Dh // 2)
    bh = max(1, min(triton.next_power_of_2(H + Hkv), TILE_ELEMS // (2 * bhalf)))
    norm, pool = call.q_weight is not None, call.pool
    qw = call.q_weight if norm else qkv
    kw = call.k_weight if norm else qkv
    ndt = torch.promote_types(qw.dtype, qkv.dtype) if norm else qkv.dtype
    pk, pv = (pool.k, pool.v) if pool is not None else (k, k)
    fp8 = pool is not None and pool.is_fp8
    ks, vs = (pool.k_scale, pool.v_scale) if fp8 else (qkv, qkv)
    slots = call.slot_mapping if pool is not None else call.positions
    launch.run(_qk_norm_rope_kernel, (T, triton.cdiv(H + Hkv, bh)), qkv, call.positions, call.cos_sin,
               qw, kw, q, k, v, pk, pv, ks, vs, slots, qkv.stride(0), call.cos_sin.stride(0),
               pk.stride(0), pk.stride(1), pv.stride(0), pv.stride(1), ks.stride(0), vs.stride(0),
               call.eps, H=H, HKV=Hkv, DH=Dh, BHALF=bhalf, BH=bh, DT=DTYPE_CODE[qkv.dtype],
               NDT=DTYPE_CODE[ndt], HAS_NORM=norm, HAS_POOL=pool is not None, IS_FP8=fp8,
               RECIP=qkv.is_cuda, num_warps=4 if bh * bhalf >= 512 else 1, **launch.pdl_args(qkv))
    return q, k, v


routes.register("rope", routes.Route("triton_qk_norm_rope", routes.DEFAULT, RECORD, _admit_triton,
                                     _run_triton))
routes.register("rope", routes.Route("torch", routes.DEFAULT, "reference (admits every call)",
                                     lambda call: None, _run_torch), reference=True)


def _validate(call: RopeCall) -> None:
    width = (call.num_heads + 2 * call.num_kv_heads) * call.head_dim
    if call.qkv.shape[-1] != width:
        raise ValueError(f"qkv has {call.qkv.shape[-1]} columns; (H + 2 Hkv) * Dh = {width}. "
                         "Pass the merged q, k, v projection output.")
    if (call.q_weight is None) != (call.k_weight is None):
        raise ValueError("qk-norm needs both q_weight and k_weight, or neither.")
    if (call.pool is None) != (call.slot_mapping is None):
        raise ValueError("a KV write needs both pool and slot_mapping, or neither.")


def qk_norm_rope(call: RopeCall, *, layer: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, H, Dh], k [T, Hkv, Dh], v [T, Hkv, Dh]) normed, rotated and written to the pool
    (module docstring), by the route the registry picks for this call."""
    _validate(call)
    call.layer = layer
    return routes.dispatch("rope", call, layer)
