"""Attention over a flat batch of sequences, reading and writing the KV cache.

Shapes: T tokens in the step (all sequences, flat), H query heads, Hkv kv heads,
Dk/Dv head dims, S = cached tokens of one sequence after this step.
The model hands q [T, H, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] for the new tokens; the
batch says where each sequence's tokens start in the flat list and how many of its tokens
the cache already holds. The cache object stores the new k/v and returns the whole
sequence's K/V [S, Hkv, D]; the reference then computes causal attention with an
optional sliding window and optional per-head sink logits (gpt-oss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch, spec: AttnSpec) -> torch.Tensor:
    """Attention for a flat batch; returns [T, H, Dv]."""
    ops = _paged_ops(batch)
    if ops is not None:
        return _paged_attention(ops, q, k, v, batch, spec)
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


def _paged_ops(batch):
    """lowbit.kernels.attention_op for a batch with paged metadata (and triton present)."""
    if batch.slot_mapping is None or batch.block_tables is None or batch.seq_lens is None:
        return None
    if not hasattr(batch.kv_cache, "layer_pool"):
        return None
    from lowbit.kernels.runtime import HAS_TRITON

    if not HAS_TRITON:
        return None
    from lowbit.kernels import attention_op

    return attention_op


def _paged_attention(ops, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch,
                     spec: AttnSpec) -> torch.Tensor:
    from lowbit.kernels.attention import KVPool

    name = f"layers.{spec.layer_idx}.attn"
    pool = KVPool(*batch.kv_cache.layer_pool(spec.layer_idx, k, v))
    ops.kv_write(k, v, pool, batch.slot_mapping, layer=name)
    call = ops.AttentionCall(q, pool, batch.block_tables, batch.seq_lens, batch.query_start,
                             batch.context_lens, batch.mode.is_decode, spec.scale, spec.window,
                             spec.sinks)
    return ops.paged_attention(call, layer=name)
