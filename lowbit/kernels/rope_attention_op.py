"""The `rope_attention` op: a GQA decode step's q/k RMSNorm + RoPE + KV write (the `rope` op)
and its paged attention (the `attention` op), for steps of one query per sequence.

Shape legend: B sequences (one new token each), H / Hkv heads, Dh head dim.
  rope_attention(RopeAttentionCall) -> o [B, H, Dh] in qkv.dtype
    q, k, v = qk_norm_rope(rope)            the rope op (rope_op's docstring), k / v written
                                            to the pool at slot_mapping
    o = paged_attention(attn with q, k, v)  the attention op over the pool
Why: at Qwen3-30B-A3B B = 1 the rope kernel moves 5 KiB and costs a launch (4.8 us alone on
the H100, docs/BENCHMARKS.md "A decode step under Nsight Compute"), one of the eleven of a
layer. The decode attention's split programs can make q themselves (each reads its G heads'
raw q, 2 KiB) and the one split holding the step's key can norm, rotate and store it.

Routes, in selection order:
  triton_rope_decode  MEASURED_NEGATIVE. The engine A/B (`bench latency --variant`, H100,
                Qwen3-30B-A3B, bench/records/20261207T151549 / T151828-latency-h100.json)
                has it slower where it was to win: nvfp4 tg128 0.965x at B = 1, 0.987x at
                B = 8 (its busy step 2,572 against 2,448 us: one launch fewer, a heavier
                kernel of 255 registers); bf16 1.011x / 1.006x. Runs when forced
                (LOWBIT_ROUTE_ROPE_ATTENTION, or `--variant x=rope_attention:triton_rope_decode`).
                The split-KV decode kernel with
                ROPE (lowbit.kernels.attention.paged_decode's `rope`): every program norms
                and rotates its G query heads' raw q in registers; the program whose split
                holds the sequence's last key (position seq_len - 1) first norms, rotates
                and stores that key and its value in the pool row slot_mapping[b] (the rope
                kernel's math and roundings, so the same pool bytes), then a CTA barrier,
                then reads it back with the rest of its split. The reduce launch as without
                it. Graph-safe (no host read). Refuses what triton_qk_norm_rope or
                triton_paged_decode refuses (partial rotary, contiguous caches, prefill and
                mixed steps).
  unfused       reference: qk_norm_rope by the rope op's routes, then paged_attention by the
                attention op's routes. Admits every call; not slow (today's path), so a
                fallback to it warns of nothing (routes.register slow=False).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lowbit.kernels import attention_op, rope_op, routes
from lowbit.kernels.attention import DecodeRope, paged_decode
from lowbit.kernels.attention_op import AttentionCall
from lowbit.kernels.rope_op import RopeCall

RECORD = ("docs/BENCHMARKS.md \"Fused decode routes, timed\" (nvfp4 B = 1 0.965x, B = 8 0.987x; "
          "bench/records/20261207T151549-latency-h100.json)")


@dataclass
class RopeAttentionCall:
    rope: RopeCall  # qkv [B, (H + 2 Hkv) Dh], positions, cos_sin, qk-norm weights, pool, slots
    attn: AttentionCall  # q: the q heads of rope.qkv [B, H, Dh] before norm and rotation
    forced: bool = False


def q_heads(qkv: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """[T, H, Dh] view of the q columns of the projection rows q | k | v."""
    return qkv[:, : num_heads * head_dim].unflatten(1, (num_heads, head_dim))


def _run_unfused(call: RopeAttentionCall) -> torch.Tensor:
    q, k, v = rope_op.qk_norm_rope(call.rope, layer=call.rope.layer)
    return attention_op.paged_attention(replace(call.attn, q=q, k=k, v=v),
                                        layer=f"layers.{call.attn.layer_idx}.attn")


def _admit_triton(call: RopeAttentionCall) -> str | None:
    if call.rope.pool is None:  # the kernel writes the step's key into it
        return "the batch carries no paged KV pool (a contiguous cache)"
    reason = rope_op._admit_triton(replace(call.rope, forced=call.forced))
    if reason is not None:
        return f"rope: {reason}"
    reason = attention_op._admit_decode(replace(call.attn, forced=call.forced))  # T == B
    return None if reason is None else f"attention: {reason}"


def _run_triton(call: RopeAttentionCall) -> torch.Tensor:
    r, a = call.rope, call.attn
    return paged_decode(a.q, a.pool, a.block_tables, a.seq_lens, a.scale, a.window, a.sinks,
                        rope=DecodeRope(r.positions, r.cos_sin, r.q_weight, r.k_weight, r.eps,
                                        r.slot_mapping))


routes.register("rope_attention", routes.Route("triton_rope_decode", routes.MEASURED_NEGATIVE, RECORD,
                                               _admit_triton, _run_triton))
routes.register("rope_attention", routes.Route(
    "unfused", routes.DEFAULT, "reference: the rope op, then the attention op, by their routes "
    "(admits every call)", lambda call: None, _run_unfused),
    reference=True, slow=False)


def rope_attention(call: RopeAttentionCall, *, layer: str = "") -> torch.Tensor:
    """o [B, H, Dh]: the rope op then the attention op (module docstring), by the route the
    registry picks for this call."""
    rope_op._validate(call.rope)
    call.rope.layer = layer
    return routes.dispatch("rope_attention", call, layer)
