"""The `kv_write`, `attention` and `latent_attention` ops over the KV cache, through the route registry.

Shape legend: T new tokens, B sequences, H/Hkv heads, Dk/Dv head dims, R pool rows.
  kv_write(k, v, pool, slot_mapping)      k [T, Hkv, Dk], v [T, Hkv, Dv] -> pool rows slot_mapping [T]
  paged_attention(q, pool, batch, spec)   q [T, H, Dk] -> [T, H, Dv]; the new tokens' K/V are
                                          already in the pool (kv_write runs first)
Routes of `attention`, in selection order (status and record in docs/ROUTES.md):
  triton_paged_decode    split-KV decode, one query per sequence (decode steps only); graph-safe
  triton_paged_prefill   varlen queries over the cached prefix (any step); graph-safe when the
                         batch carries query_start on the device (a captured prefill step)
  triton_paged           decode kernel on decode steps, prefill kernel on the others (OPT-IN:
                         the two routes above already cover every step)
  torch                  reference: gather each sequence's rows, float32 softmax; reads host
                         lengths, so decode graphs are off while it serves decode steps (on CUDA
                         only when forced, or when every Triton route refuses: then a warning)
`kv_write` has one route, torch (index_copy_: no host read, graph-safe).
Routes of `latent_attention` (MLA over the latent cache, lowbit.layers.attention):
  triton_latent_decode   decode steps over a paged pool: the step's latent written by kv_write
                         (slot mapping) unless the call says the mla_rope op already wrote it
                         (`written`), then lowbit.kernels.latent's split-KV kernel and reduce,
                         heads of one sequence sharing each latent tile; graph-safe
  triton_latent_prefill  prefill and mixed steps (the latent written as for decode): the same
                         kernel with one query per token over its causal prefix (its sequence's
                         table row and length computed on the device from the staged
                         query_start); graph-safe
  torch                  reference: per sequence, the cache's `update` and float32 attention
                         over the gathered latent; host lengths (on CUDA only when forced, or
                         for a contiguous cache)
`decode_graph_refusal(op)` / `prefill_graph_refusal(op)` say whether a captured decode /
prefill step of a model calling `op` for its attention would run a graph-safe route.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.kernels import routes
from lowbit.kernels.attention import (
    KVPool,
    dense_attention,
    paged_decode,
    paged_prefill,
    reference_kv_write,
    reference_latent_attention,
    reference_paged_attention,
)
from lowbit.kernels.latent import (
    MAX_LATENT,
    MAX_ROPE_DIM,
    latent_decode,
    latent_prefill,
    latent_splits,
)
from lowbit.kernels.runtime import capability, triton_refusal

BENCH = "docs/BENCHMARKS.md#attention"
ENGINE_RECORD = ("docs/BENCHMARKS.md#decode-graph (engine tg at the Qwen3-30B-A3B shape, H200: the torch "
                 "route kept decode eager at 15.1 tok/s bf16; with this route graphs capture: 224-235)")
GRAPH_SAFE_DECODE = ("triton_paged_decode", "triton_paged")  # routes a captured decode may run
GRAPH_SAFE_LATENT_DECODE = ("triton_latent_decode_uv", "triton_latent_decode")
GRAPH_SAFE_LATENT_PREFILL = ("triton_latent_prefill",)
GRAPH_SAFE_PREFILL = ("triton_paged_prefill", "triton_paged")  # read the staged query_start
DECODE_ONLY = ("triton_paged_decode", "triton_latent_decode_uv", "triton_latent_decode")
LATENT_RECORD = ("docs/BENCHMARKS.md#decode-graph (DeepSeek-V2-Lite bf16, H200: the torch route keeps "
                 "decode eager at 13.4 tok/s, 61.8 ms a step for 5.0 ms of kernels; this route is what "
                 "lets the step be captured; its own engine record is still to be taken)")
LATENT_PREFILL_RECORD = ("docs/BENCHMARKS.md#decode-graph (DeepSeek-V2-Lite bf16, H200: the torch route "
                         "loops over sequences with host lengths, prefill steps eager; this route is "
                         "what lets them be captured; its engine record is still to be taken)")
LATENT_UV_RECORD = ("none yet: it takes the W_UV batched GEMM into the reduce launch (one launch fewer a "
                    "layer); checked against the twin and the other routes in "
                    "tests/kernels/test_latent_attention.py and tests/gpu/test_latent_attention_gpu.py; "
                    "the engine A/B (bench latency --variant uv=latent_attention:triton_latent_decode_uv) "
                    "is to be taken")
# the fused reduce reads W_UV[h] once per (token, head): 2 MiB a token at V2-Lite / V3 (from
# L2 after the first), where the batched GEMM reads it once a step; kept to small decode batches
LATENT_UV_MAX_TOKENS = 16
MAX_HEAD_DIM = 256


@dataclass
class KVWriteCall:
    k: torch.Tensor  # [T, Hkv, Dk]
    v: torch.Tensor  # [T, Hkv, Dv]
    pool: object  # lowbit.kernels.attention.KVPool
    slot_mapping: torch.Tensor  # [T] int64
    forced: bool = False


@dataclass
class AttentionCall:
    """A paged call (pool, block tables, sequence lengths; the step's k/v already in the
    pool) or a contiguous one (pool None: the step's k/v and the cache object whose
    `update(layer, slot, start, k, v)` stores them and returns each sequence's K/V)."""

    q: torch.Tensor  # [T, H, Dk]
    pool: object | None  # KVPool: k [R, Hkv, Dk], v [R, Hkv, Dv]; None: contiguous
    block_tables: torch.Tensor | None  # [B, W] int32
    seq_lens: torch.Tensor | None  # [B] int32 (device)
    query_start: list[int]  # [B + 1] host (prefill grid, torch route)
    context_lens: list[int]  # [B] host (torch route)
    decode: bool  # one query per sequence, each over a cached context
    scale: float
    window: int | None = None
    sinks: torch.Tensor | None = None  # [H]
    forced: bool = False
    k: torch.Tensor | None = None  # [T, Hkv, Dk] (contiguous calls)
    v: torch.Tensor | None = None  # [T, Hkv, Dv]
    cache: object | None = None  # the contiguous cache, or None (no context: prefill only)
    cache_slots: list | None = None  # [B] each sequence's slot in the cache
    layer_idx: int = 0
    query_start_dev: torch.Tensor | None = None  # [B + 1] int32, the staged starts (graph-safe)


def _refusal(call: AttentionCall) -> str | None:
    q, pool = call.q, call.pool
    reason = triton_refusal(q, call.forced)
    if reason is not None:
        return reason
    if pool is None or call.block_tables is None or call.seq_lens is None:
        return "the batch carries no paged KV pool (a contiguous cache)"
    if pool.k.shape[-1] != pool.v.shape[-1]:
        return "MLA head dims differ"
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"queries are {q.dtype}"
    if pool.k.dtype not in (q.dtype, torch.float8_e4m3fn):
        return f"KV pool is {pool.k.dtype}, queries are {q.dtype}"
    if pool.is_fp8 and q.is_cuda and capability(q.device.index or 0) < (8, 9):
        return "fp8 KV needs compute capability 8.9 or newer"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}"
    if q.shape[1] % pool.k.shape[1]:
        return f"{q.shape[1]} query heads do not group over {pool.k.shape[1]} kv heads"
    return None


def _admit_decode(call: AttentionCall) -> str | None:
    if not call.decode:
        return f"not a decode step ({call.query_start[-1]} queries for {len(call.context_lens)} sequences)"
    return _refusal(call)


def _starts_on_device(query_start: list[int], device: torch.device) -> torch.Tensor:
    """query_start as int32 on the device, built once per step (every layer asks for it)."""
    key = (tuple(query_start), device)
    if _STARTS.get("key") != key:
        _STARTS["key"] = key
        _STARTS["value"] = torch.tensor(query_start, dtype=torch.int32, device=device)
    return _STARTS["value"]


_STARTS: dict = {}


def _run_decode(call: AttentionCall) -> torch.Tensor:
    return paged_decode(call.q, call.pool, call.block_tables, call.seq_lens, call.scale,
                        call.window, call.sinks)


def _run_prefill(call: AttentionCall) -> torch.Tensor:
    starts = call.query_start_dev
    if starts is None:
        starts = _starts_on_device(call.query_start, call.q.device)
    return paged_prefill(call.q, call.pool, call.block_tables, call.seq_lens, starts, call.scale,
                         call.window, call.sinks)


def _run_paged(call: AttentionCall) -> torch.Tensor:
    return _run_decode(call) if call.decode else _run_prefill(call)


def _run_torch(call: AttentionCall) -> torch.Tensor:
    if call.q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise AssertionError("the torch attention route reads host lengths; it cannot be captured")
    if call.pool is None:
        return _run_contiguous(call)
    qs = call.query_start
    lens = [c + qs[b + 1] - qs[b] for b, c in enumerate(call.context_lens)]
    return reference_paged_attention(call.q, call.pool, call.block_tables, qs, lens, call.scale,
                                     call.window, call.sinks)


def _run_contiguous(call: AttentionCall) -> torch.Tensor:
    """Per sequence: store the step's k/v through the cache's `update` and attend over the
    sequence's whole K/V (float32 scores and softmax)."""
    q, out = call.q, call.q.new_empty(call.q.shape[0], call.q.shape[1], call.v.shape[-1])
    for b, start in enumerate(call.context_lens):
        s, e = call.query_start[b], call.query_start[b + 1]
        if call.cache is not None:
            kb, vb = call.cache.update(call.layer_idx, call.cache_slots[b], start, call.k[s:e], call.v[s:e])
        else:
            assert start == 0, "a step over cached context needs a KV cache"
            kb, vb = call.k[s:e], call.v[s:e]
        out[s:e] = dense_attention(q[s:e], kb, vb, start, call.scale, call.window, call.sinks)
    return out


def layer_pool(batch, layer: int, num_kv_heads: int, head_dim: int, like: torch.Tensor) -> KVPool | None:
    """The layer's paged pool when the batch carries paged metadata (the serving engine),
    else None (the contiguous cache of model tests and distributed workers)."""
    if batch.slot_mapping is None or batch.block_tables is None or batch.seq_lens is None:
        return None
    if not hasattr(batch.kv_cache, "layer_pool"):
        return None
    shape = like.new_empty((0, num_kv_heads, head_dim))  # allocates the layer at its first call
    return KVPool(*batch.kv_cache.layer_pool(layer, shape, shape))


def _run_kv_write(call: KVWriteCall) -> None:
    reference_kv_write(call.k, call.v, call.pool, call.slot_mapping)


routes.register("kv_write", routes.Route(
    "torch", routes.DEFAULT, "reference (admits every call; index_copy_, graph-safe)",
    lambda call: None, _run_kv_write), reference=True)
routes.register("attention", routes.Route(
    "triton_paged_decode", routes.DEFAULT, ENGINE_RECORD, _admit_decode, _run_decode))
routes.register("attention", routes.Route(
    "triton_paged_prefill", routes.DEFAULT, ENGINE_RECORD, _refusal, _run_prefill))
routes.register("attention", routes.Route(
    "triton_paged", routes.OPT_IN, BENCH, _refusal, _run_paged))
routes.register("attention", routes.Route(
    "torch", routes.DEFAULT, "reference (admits every call)", lambda call: None, _run_torch),
    reference=True)


@dataclass
class LatentCall:
    """MLA over the latent cache (lowbit.layers.attention's docstring has the layout)."""

    q_lat: torch.Tensor  # [T, H, C]
    q_pe: torch.Tensor  # [T, H, Dr]
    c_kv: torch.Tensor  # [T, C]
    k_pe: torch.Tensor  # [T, Dr]
    batch: object  # ForwardBatch: query_start, context_lens, cache_slots, kv_cache (host lengths)
    layer_idx: int
    scale: float
    forced: bool = False
    written: bool = False  # the paged pool already holds c_kv / k_pe (the mla_rope op wrote them)
    # [H, Dv, C] (unit column stride): the value up-projection W_UV. Given, the op returns
    # o[t, h] = W_UV[h] @ context[t, h], [T, H, Dv], instead of the latent context
    w_uv: torch.Tensor | None = None


def _up(call: LatentCall, ctx: torch.Tensor) -> torch.Tensor:
    """The op's output from the latent context [T, H, C]: itself, or W_UV applied per head
    (one batched GEMM over heads; strided views, no copies)."""
    if call.w_uv is None:
        return ctx
    o = ctx.new_empty(ctx.shape[0], ctx.shape[1], call.w_uv.shape[1])
    torch.bmm(ctx.transpose(0, 1), call.w_uv.transpose(1, 2), out=o.transpose(0, 1))  # [H, T, Dv]
    return o


def _run_latent_torch(call: LatentCall) -> torch.Tensor:
    """Per sequence: store the step's latent through the cache's `update` contract (one-head
    "k" = c_kv [L, 1, C], "v" = k_pe [L, 1, Dr]) and attend over the whole latent."""
    batch, out = call.batch, call.q_lat.new_empty(call.q_lat.shape)
    for b in range(batch.num_seqs):
        s, e = batch.query_start[b], batch.query_start[b + 1]
        start = batch.context_lens[b]
        if batch.kv_cache is not None:
            slot = batch.cache_slots[b]
            if slot is None:  # a CUDA graph's static batch: its warm-up turns the bucket eager
                raise RuntimeError("the torch latent_attention route reads per-sequence host slots, "
                                   "which a step that must not synchronize does not carry")
            kb, pb = batch.kv_cache.update(call.layer_idx, slot, start,
                                           call.c_kv[s:e, None], call.k_pe[s:e, None])  # [S, 1, C], [S, 1, Dr]
            kb, pb = kb[:, 0], pb[:, 0]
        else:
            assert start == 0, "a step over cached context needs a KV cache"
            kb, pb = call.c_kv[s:e], call.k_pe[s:e]
        out[s:e] = reference_latent_attention(call.q_lat[s:e], call.q_pe[s:e], kb, pb, start, call.scale)
    return _up(call, out)


def _admit_latent_decode(call: LatentCall) -> str | None:
    if not call.batch.mode.is_decode:
        return "not a decode step (prefill and mixed steps: triton_latent_prefill)"
    return _admit_latent(call)


def _admit_latent(call: LatentCall) -> str | None:
    q, batch = call.q_lat, call.batch
    reason = triton_refusal(q, call.forced)
    if reason is not None:
        return reason
    cache = batch.kv_cache
    if batch.slot_mapping is None or batch.block_tables is None or batch.seq_lens is None \
            or not hasattr(cache, "layer_pool"):
        return "the batch carries no paged KV pool (a contiguous cache)"
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or call.q_pe.dtype != q.dtype:
        return f"queries are {q.dtype} / {call.q_pe.dtype}"
    if cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        return f"KV pool is {cache.dtype}, queries are {q.dtype}"
    if cache.dtype == torch.float8_e4m3fn and q.is_cuda and capability(q.device.index or 0) < (8, 9):
        return "fp8 KV needs compute capability 8.9 or newer"
    if q.shape[-1] > MAX_LATENT or call.q_pe.shape[-1] > MAX_ROPE_DIM:
        return f"latent {q.shape[-1]} > {MAX_LATENT} or rope dims {call.q_pe.shape[-1]} > {MAX_ROPE_DIM}"
    return None


def _latent_pool(call: LatentCall) -> KVPool:
    """The layer's pool, the step's latent written into it at the slot mapping (device-side)
    unless the mla_rope op did."""
    batch = call.batch
    c_kv, k_pe = call.c_kv[:, None], call.k_pe[:, None]  # [T, 1, C], [T, 1, Dr]
    pool = KVPool(*batch.kv_cache.layer_pool(call.layer_idx, c_kv, k_pe))
    if not call.written:
        kv_write(c_kv, k_pe, pool, batch.slot_mapping, layer=f"layers.{call.layer_idx}.attn")
    return pool


def _run_latent_decode(call: LatentCall) -> torch.Tensor:
    """The split-KV kernel and its reduce; W_UV (when given) as a batched GEMM after."""
    pool, batch = _latent_pool(call), call.batch
    return _up(call, latent_decode(call.q_lat, call.q_pe, pool, batch.block_tables, batch.seq_lens, call.scale))


def _admit_latent_decode_uv(call: LatentCall) -> str | None:
    if call.w_uv is None:
        return "no W_UV given: the op returns the latent context"
    t = call.q_lat.shape[0]
    if t > LATENT_UV_MAX_TOKENS:
        return f"{t} tokens > {LATENT_UV_MAX_TOKENS}: W_UV as one batched GEMM reads it once a step"
    reason = _admit_latent_decode(call)
    if reason is not None:
        return reason
    w = call.w_uv
    if w.dtype != call.q_lat.dtype or w.stride(-1) != 1 or w.shape[0] != call.q_lat.shape[1] \
            or w.shape[2] != call.q_lat.shape[2]:
        return f"W_UV {list(w.shape)} {w.dtype} does not fit queries {list(call.q_lat.shape)} {call.q_lat.dtype}"
    if latent_splits(call.q_lat, call.batch.kv_cache.block_size, call.batch.block_tables) == 1:
        return "one split: the split kernel writes the context itself (W_UV as a batched GEMM)"
    return None


def _run_latent_decode_uv(call: LatentCall) -> torch.Tensor:
    """The split-KV kernel, then the reduce with W_UV applied in the same launch."""
    pool, batch = _latent_pool(call), call.batch
    return latent_decode(call.q_lat, call.q_pe, pool, batch.block_tables, batch.seq_lens, call.scale,
                         w_uv=call.w_uv)


def _run_latent_prefill(call: LatentCall) -> torch.Tensor:
    """Write the step's latents at the slot mapping, then one query per token over its prefix."""
    pool, batch = _latent_pool(call), call.batch
    starts = batch.query_start_dev
    if starts is None:
        starts = _starts_on_device(batch.query_start, call.q_lat.device)
    return _up(call, latent_prefill(call.q_lat, call.q_pe, pool, batch.block_tables, batch.seq_lens, starts,
                                    call.scale))


routes.register("latent_attention", routes.Route(
    "triton_latent_decode_uv", routes.OPT_IN, LATENT_UV_RECORD, _admit_latent_decode_uv, _run_latent_decode_uv))
routes.register("latent_attention", routes.Route(
    "triton_latent_decode", routes.DEFAULT, LATENT_RECORD, _admit_latent_decode, _run_latent_decode))
routes.register("latent_attention", routes.Route(
    "triton_latent_prefill", routes.DEFAULT, LATENT_PREFILL_RECORD, _admit_latent, _run_latent_prefill))
routes.register("latent_attention", routes.Route(
    "torch", routes.DEFAULT, "reference (admits every call; host lengths: decode graphs are off "
    "while it serves decode steps)", lambda call: None, _run_latent_torch), reference=True)


def latent_attention(call: LatentCall, *, layer: str = "") -> torch.Tensor:
    """MLA's latent context [T, H, C] for a flat batch (with call.w_uv: W_UV applied, [T, H,
    Dv]), by the route the registry picks."""
    return routes.dispatch("latent_attention", call, layer)


def kv_write(k: torch.Tensor, v: torch.Tensor, pool, slot_mapping: torch.Tensor, *, layer: str = "") -> None:
    """Store the step's k/v rows into the pool (fp8 pools: with per-token-per-head scales)."""
    routes.dispatch("kv_write", KVWriteCall(k, v, pool, slot_mapping), layer)


def paged_attention(call: AttentionCall, *, layer: str = "") -> torch.Tensor:
    """[T, H, Dv] in q.dtype, by the route the registry picks for this call (paged or
    contiguous: the Triton routes refuse a contiguous call, the torch route takes both)."""
    return routes.dispatch("attention", call, layer)


def decode_graph_refusal(op: str = "attention") -> str | None:
    """Why a captured decode step would not run a graph-safe route of `op` (`attention`, or
    `latent_attention` for MLA models), or None. Admission is per call; this answers for the
    routes the registry could pick."""
    safe = {"attention": GRAPH_SAFE_DECODE, "latent_attention": GRAPH_SAFE_LATENT_DECODE}[op]
    env = f"{routes.ENV_PREFIX}{op.upper()}"
    forced = routes.forced_name(op)
    if forced is not None:
        if forced in safe:
            return None
        return f"{env}={forced} is not a graph-safe decode route"
    for route in routes.ops()[op].routes:
        if route.status == routes.DEFAULT:
            if route.name in safe:
                return None
            break
    return (f"decode {op} runs the torch route, which reads host lengths "
            f"(force {env}={safe[-1]} to capture decode graphs)")


def prefill_graph_refusal(op: str = "attention") -> str | None:
    """Why a captured prefill or mixed step would not run a graph-safe route of `op`, or
    None. MLA's `latent_attention` prefill is graph-safe through triton_latent_prefill."""
    safe = {"attention": GRAPH_SAFE_PREFILL, "latent_attention": GRAPH_SAFE_LATENT_PREFILL}[op]
    env = f"{routes.ENV_PREFIX}{op.upper()}"
    forced = routes.forced_name(op)
    if forced is not None:
        return None if forced in safe else f"{env}={forced} is not a graph-safe prefill route"
    for route in routes.ops()[op].routes:
        if route.status == routes.DEFAULT and route.name not in DECODE_ONLY:
            if route.name in safe:
                return None
            break
    return f"prefill {op} runs the torch route, which reads host lengths"
