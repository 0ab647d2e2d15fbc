"""Attention over a flat batch of sequences, reading and writing the KV cache.

Shapes: T tokens in the step (all sequences, flat), H query heads, Hkv kv heads,
Dk/Dv head dims, S = cached tokens of one sequence after this step.
The model hands q [T, H, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] for the new tokens; the
batch says where each sequence's tokens start in the flat list and how many of its tokens
the cache already holds. This module is wiring: the `attention` op
(lowbit.kernels.attention_op) decides how, from the batch: the paged pool of the serving
engine (Triton kernels on CUDA), or a contiguous cache whose `update` stores the new k/v
and returns each sequence's K/V (the torch route: causal attention with an optional
sliding window and optional per-head sink logits, as gpt-oss has).

MLA (DeepSeek-V2/V3) caches the compressed latent instead, shared by all heads: C latent
values c_kv and Dr rope'd key values k_pe per token. `latent_attention` takes the queries
already in latent space (absorbed weights, see lowbit.models.deepseek_v3): q_lat [T, H, C],
q_pe [T, H, Dr], and the step's c_kv [T, C], k_pe [T, Dr]. It stores them through the same
`update` contract, as a one-head "k" [L, 1, C] (c_kv) and "v" [L, 1, Dr] (k_pe), so the
contiguous and paged caches (and their fp8 scales, per token for each part) serve it as
they are, and returns the latent context [T, H, C]:
  scores = (q_lat . c_kv + q_pe . k_pe) * scale      # [H, L, S]
  out    = softmax(causal(scores)) @ c_kv            # [L, H, C]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.kernels import attention_op, rope_attention_op
from lowbit.kernels.attention import KVPool
from lowbit.kernels.rope_op import RopeCall


@dataclass
class AttnSpec:
    layer_idx: int
    scale: float
    window: int | None = None  # a query at cache index i sees keys j with i - window < j <= i
    sinks: torch.Tensor | None = None  # [H] extra logit per head that takes probability mass


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch, spec: AttnSpec,
              pool: KVPool | None = None) -> torch.Tensor:
    """Attention for a flat batch; returns [T, H, Dv]. With `pool` the step's k/v are
    already in it (the rope op wrote them)."""
    layer = f"layers.{spec.layer_idx}.attn"
    if pool is None:
        pool = attention_op.layer_pool(batch, spec.layer_idx, k.shape[1], k.shape[2], k)
        if pool is not None:
            attention_op.kv_write(k, v, pool, batch.slot_mapping, layer=layer)
    return attention_op.paged_attention(_call(q, k, v, batch, spec, pool), layer=layer)


def rope_attention(rope: RopeCall, batch, spec: AttnSpec, *, layer: str = "") -> torch.Tensor:
    """A decode step's rope op (q/k norm, RoPE, the KV write into rope.pool) and its
    attention, through the one `rope_attention` op (lowbit.kernels.rope_attention_op), which
    may run both in the decode kernel; returns [B, H, Dh]."""
    q = rope_attention_op.q_heads(rope.qkv, rope.num_heads, rope.head_dim)
    call = rope_attention_op.RopeAttentionCall(rope, _call(q, None, None, batch, spec, rope.pool))
    return rope_attention_op.rope_attention(call, layer=layer)


def _call(q, k, v, batch, spec: AttnSpec, pool: KVPool | None) -> attention_op.AttentionCall:
    return attention_op.AttentionCall(q, pool, batch.block_tables, batch.seq_lens, batch.query_start,
                                      batch.context_lens, batch.mode.is_decode, spec.scale, spec.window,
                                      spec.sinks, k=k, v=v, cache=batch.kv_cache,
                                      cache_slots=batch.cache_slots, layer_idx=spec.layer_idx,
                                      query_start_dev=batch.query_start_dev)


# -- MLA over the latent cache ------------------------------------------------------------
def latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                     batch, spec: AttnSpec, written: bool = False,
                     w_uv: torch.Tensor | None = None) -> torch.Tensor:
    """MLA for a flat batch over the latent cache; returns the latent context [T, H, C], or
    with w_uv [H, Dv, C] the per-head values W_UV[h] @ context [T, H, Dv].
    written: the step's c_kv / k_pe are already in the paged pool (the mla_rope op wrote them)."""
    call = attention_op.LatentCall(q_lat, q_pe, c_kv, k_pe, batch, spec.layer_idx, spec.scale, written=written,
                                   w_uv=w_uv)
    return attention_op.latent_attention(call, layer=f"layers.{spec.layer_idx}.attn")
