"""The `mla_rope` op of an MLA layer: kv_a_layernorm, RoPE of q_pe and k_pe, and the latent
cache write, in one door (the MLA counterpart of rope_op's q/k-norm + rope + KV write).

Shape legend: T tokens, H heads, Dn qk_nope_head_dim, Dr qk_rope_head_dim (even), Dq = Dn + Dr,
C kv_lora_rank, P table positions, R pool rows.
  mla_rope(MlaRopeCall) -> q_pe [T, H, Dr], c_kv [T, C], k_pe [T, Dr], fresh and contiguous
    q     [T, H * Dq]  the query projection: head h at columns h * Dq, q_pe its last Dr
    kv_a  [T, C + Dr]  kv_a_proj_with_mqa's output: the latent, then the shared rope key
    c_kv  = rms_norm(kv_a[:, :C], weight, eps)           (norm_op's convention and roundings)
    q_pe, k_pe = rotate(q[..., Dn:]), rotate(kv_a[:, C:]): "neox" pairs (i, i + Dr/2) in
           float32, rounded to q's dtype once; with `interleaved` (rope_interleave: V2
           always, V3's default) the pairs are (2i, 2i + 1), read de-interleaved (evens, then
           odds) and written rotated as halves, the layout lowbit.models.deepseek_v3 uses
           for q and k alike; cos, sin = cos_sin[positions, :Dr/2], cos_sin[positions, Dr/2:]
    pool.k[slot_mapping], pool.v[slot_mapping] = c_kv, k_pe when a pool is given (the latent
           pool as one kv head: k [R, 1, C], v [R, 1, Dr]), as attention.reference_kv_write
           stores them (fp8 pools: codes x / s, s = amax / 448 per token and part)

Routes, in selection order:
  triton_mla_rope  (DEFAULT) one launch per step and layer for all
                   of it; graph-safe: positions and slots are read from device memory, the
                   launch depends on shapes only
  torch            reference: slices, norm_op's torch math, rope_op.rotate_neox, then the
                   `kv_write` op (admits every call)

Kernel `_mla_rope_kernel`, grid (T,). Program t rotates the H query heads of token t, BH at
a time as [BH, Dr/2] tiles per half, then the k_pe row, then norms the latent row [C] (one
block: C <= MAX_LATENT) and writes both to the pool row slot_mapping[t].
Memory layout: q and kv_a rows of unit element stride (any row stride: views of one merged
projection output); cos_sin [P, Dr] float32 rows of unit stride; pool.k [R, 1, C], pool.v
[R, 1, Dr] of unit stride over the last dim, k_scale / v_scale [R, 1] float32 (fp8).
Invariants: positions < P; a slot < 0 writes nothing (the torch route's index_copy_ rejects
it); the norm weight has kv_a's dtype, so every stored value is exact in the pool's dtype
(or, fp8, an e4m3 code and scale computed with reference_kv_write's roundings, as rope_op's
kernel does).
Results equal the torch route's except where the fp32 sum of squares, summed in another
order, moves a normed value across a rounding boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowbit.kernels import attention_op, launch, routes
from lowbit.kernels.attention import FP8, KVPool, kv_fp8_codes, kv_fp8_scale
from lowbit.kernels.latent import MAX_LATENT, MAX_ROPE_DIM
from lowbit.kernels.norm_op import DTYPE_CODE, FLOAT_DTYPES, rms_norm_reference, round_to
from lowbit.kernels.pdl import pdl_enter
from lowbit.kernels.rope_op import rotate_neox
from lowbit.kernels.runtime import capability, tl, triton, triton_refusal

# DEFAULT on its H100 record: DeepSeek-V2-Lite bf16 decode 223 -> 304 tok/s at C1 with triton_silu_mul
RECORD = ("docs/BENCHMARKS.md#deepseek-mla-fused-routes-h100 (with triton_silu_mul: V2-Lite bf16 tg32 C1 "
          "223 -> 304 tok/s, 51.1 -> 18.1 kernels per layer, H100)")
TILE_ELEMS = 2048  # elements of one program's [BH, Dr/2] head tile


@dataclass
class MlaRopeCall:
    q: torch.Tensor  # [T, H * (Dn + Dr)]
    kv_a: torch.Tensor  # [T, C + Dr]
    num_heads: int
    nope_dim: int  # Dn
    rope_dim: int  # Dr
    positions: torch.Tensor  # [T] int64
    cos_sin: torch.Tensor  # [P, Dr] float32
    weight: torch.Tensor  # [C] kv_a_layernorm
    eps: float
    interleaved: bool
    pool: KVPool | None = None  # k [R, 1, C], v [R, 1, Dr]
    slot_mapping: torch.Tensor | None = None  # [T] int64
    forced: bool = False
    layer: str = field(default="", repr=False)  # the caller, for the kv_write counters

    @property
    def latent_dim(self) -> int:
        return self.kv_a.shape[-1] - self.rope_dim


def latent_pool(batch, layer: int, C: int, Dr: int, like: torch.Tensor) -> KVPool | None:
    """The layer's latent pool (k [R, 1, C], v [R, 1, Dr]) when the batch carries paged
    metadata (the serving engine), else None (the contiguous cache, the profiling forward)."""
    if batch.slot_mapping is None or batch.block_tables is None or batch.seq_lens is None:
        return None
    if not hasattr(batch.kv_cache, "layer_pool"):
        return None
    c, p = like.new_empty((0, 1, C)), like.new_empty((0, 1, Dr))  # shapes for the first allocation
    return KVPool(*batch.kv_cache.layer_pool(layer, c, p))


# -- torch reference ---------------------------------------------------------------------------
def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """x [..., Dr]: the pairs (2i, 2i + 1) moved to (i, i + Dr/2) (evens, then odds)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _run_torch(call: MlaRopeCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, H, Dn, Dr, C = call.kv_a.shape[0], call.num_heads, call.nope_dim, call.rope_dim, call.latent_dim
    q_pe = call.q.view(T, H, Dn + Dr)[..., Dn:]  # [T, H, Dr]
    latent, k_pe = call.kv_a.split([C, Dr], dim=-1)  # [T, C], [T, Dr]
    c_kv = rms_norm_reference(latent, call.weight, call.eps)
    k_pe = k_pe[:, None]  # [T, 1, Dr]
    if call.interleaved:
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
    cs = call.cos_sin[call.positions]  # [T, Dr]
    cos, sin = cs[:, : Dr // 2], cs[:, Dr // 2 :]
    q_pe, k_pe = rotate_neox(q_pe, cos, sin), rotate_neox(k_pe, cos, sin)
    if call.pool is not None:
        attention_op.kv_write(c_kv[:, None], k_pe, call.pool, call.slot_mapping, layer=call.layer)
    return q_pe.contiguous(), c_kv.contiguous(), k_pe[:, 0].contiguous()


# -- Triton --------------------------------------------------------------------------------------
@triton.jit
def _rotate(src, o1, o2, mask, cos, sin, DT: tl.constexpr):
    """The rotated halves (float32, rounded to DT) of the rope dims at src + o1 / src + o2."""
    x1 = tl.load(src + o1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + o2, mask=mask, other=0.0).to(tl.float32)
    return round_to(x1 * cos - x2 * sin, DT), round_to(x2 * cos + x1 * sin, DT)


@triton.jit
def _store_row(dst, scale_dst, x1, x2, n1, n2, m1, m2, IS_FP8: tl.constexpr, RECIP: tl.constexpr):
    """One pool row from two float32 pieces x1 (at dst + n1), x2 (at dst + n2): as they are,
    or fp8 codes with the row's scale (attention.kv_fp8_scale, as every pool write) at scale_dst."""
    if IS_FP8:
        s = kv_fp8_scale(tl.maximum(tl.max(tl.abs(x1), 0), tl.max(tl.abs(x2), 0)), RECIP)
        x1, x2 = (kv_fp8_codes(x1, tl.zeros_like(x1) + s, not RECIP),
                  kv_fp8_codes(x2, tl.zeros_like(x2) + s, not RECIP))
        tl.store(scale_dst, s)
    tl.store(dst + n1, x1, mask=m1)
    tl.store(dst + n2, x2, mask=m2)


@triton.jit
def _mla_rope_kernel(q_ptr, kv_ptr, pos_ptr, cs_ptr, w_ptr, qpe_ptr, ckv_ptr, kpe_ptr,
                     pc_ptr, pp_ptr, sc_ptr, sp_ptr, slot_ptr, stride_q, stride_kv, stride_cs,
                     stride_pc, stride_pp, stride_sc, stride_sp, eps, c_float,
                     H: tl.constexpr, DN: tl.constexpr, DR: tl.constexpr, C: tl.constexpr,
                     BC: tl.constexpr, BHALF: tl.constexpr, BH: tl.constexpr,
                     INTERLEAVED: tl.constexpr, DT: tl.constexpr, HAS_POOL: tl.constexpr,
                     IS_FP8: tl.constexpr, RECIP: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = DR // 2
    j = tl.arange(0, BHALF)
    col = j < half
    if INTERLEAVED:  # pair i is (2i, 2i + 1)
        o1, o2 = 2 * j, 2 * j + 1
    else:
        o1, o2 = j, j + half
    p = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + p * stride_cs + j, mask=col, other=0.0)
    sin = tl.load(cs_ptr + p * stride_cs + half + j, mask=col, other=0.0)
    for h0 in tl.static_range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        hm = (h < H)[:, None] & col[None, :]
        src = q_ptr + t * stride_q + h[:, None] * (DN + DR) + DN
        r1, r2 = _rotate(src, o1[None, :], o2[None, :], hm, cos[None, :], sin[None, :], DT)
        dst = qpe_ptr + (t * H + h[:, None]) * DR + j[None, :]
        tl.store(dst, r1, mask=hm)
        tl.store(dst + half, r2, mask=hm)
    k1, k2 = _rotate(kv_ptr + t * stride_kv + C, o1, o2, col, cos, sin, DT)  # [BHALF]
    tl.store(kpe_ptr + t * DR + j, k1, mask=col)
    tl.store(kpe_ptr + t * DR + half + j, k2, mask=col)
    c = tl.arange(0, BC)
    cm = c < C
    x = tl.load(kv_ptr + t * stride_kv + c, mask=cm, other=0.0).to(tl.float32)  # [BC]
    mean_sq = tl.math.div_rn(tl.sum(x * x, 0), c_float)
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
    w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    y = round_to(w * round_to(x * inv, DT), DT)  # the weight has x's dtype: one rounding each
    tl.store(ckv_ptr + t * C + c, y, mask=cm)
    if HAS_POOL:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            # c_kv as two pieces (x, nothing) so that one helper writes both rows
            _store_row(pc_ptr + slot * stride_pc, sc_ptr + slot * stride_sc, y, tl.zeros_like(y), c, c,
                       cm, cm & (c < 0), IS_FP8, RECIP)
            _store_row(pp_ptr + slot * stride_pp, sp_ptr + slot * stride_sp, k1, k2, j, j + half,
                       col, col, IS_FP8, RECIP)


def _shape_refusal(call: MlaRopeCall) -> str | None:
    q, kv, Dr = call.q, call.kv_a, call.rope_dim
    if q.dtype not in FLOAT_DTYPES or kv.dtype != q.dtype:
        return f"q is {q.dtype}, kv_a is {kv.dtype} (the kernel takes one of bf16, fp16, float32)"
    for name, t in (("q", q), ("kv_a", kv)):
        if t.dim() != 2 or t.stride(-1) != 1:
            return f"{name} rows are not contiguous (shape {tuple(t.shape)}, strides {t.stride()})"
    if Dr % 2 or Dr > MAX_ROPE_DIM or not 0 < call.latent_dim <= MAX_LATENT:
        return f"rope dims {Dr} (even, <= {MAX_ROPE_DIM}) or latent {call.latent_dim} (<= {MAX_LATENT})"
    cs = call.cos_sin
    if cs.dim() != 2 or cs.shape[-1] != Dr or cs.dtype != torch.float32 or cs.stride(-1) != 1:
        return f"cos_sin {tuple(cs.shape)} {cs.dtype} is not a float32 [positions, {Dr}] table"
    w = call.weight
    if w.dtype != q.dtype or tuple(w.shape) != (call.latent_dim,) or w.stride(0) != 1:
        return f"norm weight is {w.dtype} {tuple(w.shape)} (one contiguous {q.dtype} per latent dim)"
    return None


def _pool_refusal(call: MlaRopeCall) -> str | None:
    pool = call.pool
    if pool is None:
        return None
    for name, t, width in (("k", pool.k, call.latent_dim), ("v", pool.v, call.rope_dim)):
        if t.dtype not in (call.q.dtype, FP8) or t.dtype != pool.k.dtype:
            return f"latent pool is {t.dtype}, q is {call.q.dtype}"
        if tuple(t.shape[1:]) != (1, width) or t.stride(-1) != 1:
            return f"pool.{name} {tuple(t.shape)} is not [rows, 1, {width}] with unit stride"
    if pool.is_fp8:
        if call.q.is_cuda and capability(call.q.device.index or 0) < (8, 9):
            return "fp8 KV needs compute capability 8.9 or newer"
        for name, s in (("k_scale", pool.k_scale), ("v_scale", pool.v_scale)):
            if s is None or s.dtype != torch.float32 or s.dim() != 2:
                return f"fp8 pool's {name} is not float32 [rows, 1]"
    return None


def _admit_triton(call: MlaRopeCall) -> str | None:
    return triton_refusal(call.q, call.forced) or _shape_refusal(call) or _pool_refusal(call)


def _empty(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A fresh output (uninitialised: the kernel writes every element; tests poison it)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _run_triton(call: MlaRopeCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, kv = call.q, call.kv_a
    T, H, Dn, Dr, C = kv.shape[0], call.num_heads, call.nope_dim, call.rope_dim, call.latent_dim
    q_pe, c_kv, k_pe = _empty((T, H, Dr), q), _empty((T, C), q), _empty((T, Dr), q)
    if T == 0:
        return q_pe, c_kv, k_pe
    pool = call.pool
    fp8 = pool is not None and pool.is_fp8
    pc, pp = (pool.k, pool.v) if pool is not None else (c_kv, k_pe)  # any pointer when unused
    sc, sp = (pool.k_scale, pool.v_scale) if fp8 else (c_kv, k_pe)
    slots = call.slot_mapping if pool is not None else call.positions
    bhalf = max(2, triton.next_power_of_2(Dr // 2))
    bh = max(1, min(triton.next_power_of_2(H), TILE_ELEMS // bhalf))
    bc = triton.next_power_of_2(C)
    launch.run(_mla_rope_kernel, (T,), q, kv, call.positions, call.cos_sin, call.weight, q_pe, c_kv, k_pe,
               pc, pp, sc, sp, slots, q.stride(0), kv.stride(0), call.cos_sin.stride(0),
               pc.stride(0), pp.stride(0), sc.stride(0) if fp8 else 0, sp.stride(0) if fp8 else 0,
               call.eps, float(C), H=H, DN=Dn, DR=Dr, C=C, BC=bc, BHALF=bhalf, BH=bh,
               INTERLEAVED=call.interleaved, DT=DTYPE_CODE[q.dtype], HAS_POOL=pool is not None,
               IS_FP8=fp8, RECIP=q.is_cuda, num_warps=4 if max(bc, bh * bhalf) >= 512 else 2,
               **launch.pdl_args(q))
    return q_pe, c_kv, k_pe


routes.register("mla_rope", routes.Route("triton_mla_rope", routes.DEFAULT, RECORD, _admit_triton,
                                         _run_triton))
routes.register("mla_rope", routes.Route("torch", routes.DEFAULT, "reference (admits every call)",
                                         lambda call: None, _run_torch), reference=True)


def _validate(call: MlaRopeCall) -> None:
    T, H, Dq = call.kv_a.shape[0], call.num_heads, call.nope_dim + call.rope_dim
    if call.q.shape != (T, H * Dq):
        raise ValueError(f"q is {tuple(call.q.shape)}; [T, H * (Dn + Dr)] = [{T}, {H * Dq}]. "
                         "Pass the query projection's output as rows.")
    if call.latent_dim <= 0 or call.weight.shape[-1] != call.latent_dim:
        raise ValueError(f"kv_a has {call.kv_a.shape[-1]} columns for Dr = {call.rope_dim} and a norm "
                         f"of {call.weight.shape[-1]}: expected C + Dr.")
    if (call.pool is None) != (call.slot_mapping is None):
        raise ValueError("a latent write needs both pool and slot_mapping, or neither.")


def mla_rope(call: MlaRopeCall, *, layer: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_pe [T, H, Dr], c_kv [T, C], k_pe [T, Dr]) normed, rotated and written to the latent
    pool (module docstring), by the route the registry picks for this call."""
    _validate(call)
    call.layer = layer
    return routes.dispatch("mla_rope", call, layer)
