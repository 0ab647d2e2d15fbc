"""Attention over a flat batch of sequences, reading and writing the KV cache.

Shapes: T tokens in the step (all sequences, flat), H query heads, Hkv kv heads,
Dk/Dv head dims, S = cached tokens of one sequence after this step.
The model hands q [T, H, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] for the new tokens; the
batch says where each sequence's tokens start in the flat list and how many of its tokens
the cache already holds. The cache object stores the new k/v and returns the whole
sequence's K/V [S, Hkv, D]; the reference then computes causal attention with an
optional sliding window and optional per-head sink logits (gpt-oss).

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

from lowbit.kernels import attention_op
from lowbit.kernels.attention import KVPool


@dataclass
class AttnSpec:
    layer_idx: int
    scale: float
    window: int | None = None  # a query at cache index i sees keys j with i - window < j <= i
    sinks: torch.Tensor | None = None  # [H] extra logit per head that takes probability mass


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, spec: AttnSpec
) -> torch.Tensor:
    """q [L, H, Dk] at cache indices q_start..q_start+L-1; k [S, Hkv, Dk], v [S, Hkv, Dv]."""
    L, H, _ = q.shape
    S, Hkv, _ = k.shape
    rep = H // Hkv
    k = k.repeat_interleave(rep, dim=1)  # [S, H, Dk]: head h reads kv head h // rep
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.float(), k.float()) * spec.scale  # [H, L, S]
    qi = torch.arange(q_start, q_start + L, device=q.device)[:, None]
    kj = torch.arange(S, device=q.device)[None, :]
    visible = kj <= qi
    if spec.window is not None:
        visible &= kj > qi - spec.window
    scores = scores.masked_fill(~visible, float("-inf"))
    if spec.sinks is not None:
        sink = spec.sinks.float().view(H, 1, 1).expand(H, L, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hls,shd->lhd", probs, v.float())
    return out.to(q.dtype)


def kv_pool(batch, layer: int, num_kv_heads: int, head_dim: int, like: torch.Tensor) -> KVPool | None:
    """The layer's paged pool when the batch carries paged metadata (the serving engine),
    else None (the contiguous cache of model tests and distributed workers)."""
    if batch.slot_mapping is None or batch.block_tables is None or batch.seq_lens is None:
        return None
    if not hasattr(batch.kv_cache, "layer_pool"):
        return None
    shape = like.new_empty((0, num_kv_heads, head_dim))  # allocates the layer at its first call
    return KVPool(*batch.kv_cache.layer_pool(layer, shape, shape))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch, spec: AttnSpec,
              pool: KVPool | None = None) -> torch.Tensor:
    """Attention for a flat batch; returns [T, H, Dv]. With `pool` the step's k/v are
    already in it (the rope op wrote them) and the attention op reads it."""
    if pool is None:
        pool = kv_pool(batch, spec.layer_idx, k.shape[1], k.shape[2], k)
        if pool is not None:
            attention_op.kv_write(k, v, pool, batch.slot_mapping, layer=f"layers.{spec.layer_idx}.attn")
    if pool is not None:
        call = attention_op.AttentionCall(q, pool, batch.block_tables, batch.seq_lens, batch.query_start,
                                          batch.context_lens, batch.mode.is_decode, spec.scale,
                                          spec.window, spec.sinks)
        return attention_op.paged_attention(call, layer=f"layers.{spec.layer_idx}.attn")
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for b in range(batch.num_seqs):
        s, e = batch.query_start[b], batch.query_start[b + 1]
        start = batch.context_lens[b]
        if batch.kv_cache is not None:
            kb, vb = batch.kv_cache.update(spec.layer_idx, batch.cache_slots[b], start, k[s:e], v[s:e])
        else:
            assert start == 0, "a step over cached context needs a KV cache"
            kb, vb = k[s:e], v[s:e]
        out[s:e] = reference_attention(q[s:e], kb, vb, start, spec)
    return out


# -- MLA over the latent cache ------------------------------------------------------------
def latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                     batch, spec: AttnSpec) -> torch.Tensor:
    """MLA for a flat batch over the latent cache; returns the latent context [T, H, C]."""
    call = attention_op.LatentCall(q_lat, q_pe, c_kv, k_pe, batch, spec.layer_idx, spec.scale)
    return attention_op.latent_attention(call, layer=f"layers.{spec.layer_idx}.attn")
