"""Qwen3 (dense) and Qwen3-MoE: GQA with per-head RMSNorm on q and k (QK-norm), RoPE,
and either a gated MLP or a softmax top-k MoE block per layer.

Shapes: T tokens, D hidden, H/Hkv heads, Dh head_dim.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.kernels.attention_op import layer_pool
from lowbit.kernels.moe_slots import SlotSum
from lowbit.kernels.norm_gate_op import norm_gate
from lowbit.kernels.rope_op import RopeCall, qk_norm_rope
from lowbit.kernels.weights import concat_rows
from lowbit.layers.attention import AttnSpec, attention, rope_attention
from lowbit.layers.linear import Linear
from lowbit.layers.mlp import GatedMLP
from lowbit.layers.moe import RouterSpec, SparseMoE
from lowbit.layers.norm import RMSNorm
from lowbit.layers.rope import RotaryEmbedding
from lowbit.models.base import CausalLM
from lowbit.models.config import ArchConfig


def merge_linears(parts: list[Linear], prefix: str) -> Linear | None:
    """One Linear serving `parts` (same in_features) as consecutive output rows, or None.
    Plain weights are concatenated; LUT-quantized ones become one kernel-side weight whose rows
    keep their own tables (lowbit.kernels.weights.concat_rows); a bias missing on some part
    is zero there. Parts of different Linear kinds do not merge (a tensor-parallel shard beside a
    replicated projection keeps its own)."""
    if len({type(p) for p in parts}) != 1 or not isinstance(parts[0], Linear):
        return None
    weights = [p.weight for p in parts]
    if all(isinstance(w, torch.Tensor) for w in weights):
        merged_w = nn.Parameter(torch.cat(weights), requires_grad=False)
    else:
        merged_w = concat_rows(weights)
        if merged_w is None:
            return None
    with torch.device("meta"):  # the parameters are replaced below
        merged = Linear(parts[0].in_features, sum(p.out_features for p in parts),
                        any(p.bias is not None for p in parts), prefix)
    if isinstance(merged_w, nn.Parameter):
        merged.weight = merged_w
    else:
        del merged._parameters["weight"]
        merged.weight = merged_w
    if merged.bias is not None:
        ref = next(p.bias for p in parts if p.bias is not None)
        biases = [p.bias if p.bias is not None else ref.new_zeros(p.out_features) for p in parts]
        merged.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    return merged


class GQAttention(nn.Module):
    """q, k, v as one merged projection (or three, until `merge_qkv`), then the rope op
    (q/k-norm, RoPE from the shared table, the KV-cache write: one kernel), attention, o_proj."""

    def __init__(self, cfg: ArchConfig, i: int, prefix: str, qk_norm: bool,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        H, Hkv, Dh, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.H, self.Hkv, self.Dh, self.prefix = H, Hkv, Dh, prefix
        bias = cfg.attention_bias
        self.q_proj = Linear(D, H * Dh, bias, f"{prefix}.q_proj")
        self.k_proj = Linear(D, Hkv * Dh, bias, f"{prefix}.k_proj")
        self.v_proj = Linear(D, Hkv * Dh, bias, f"{prefix}.v_proj")
        self.qkv_proj: Linear | None = None
        self.o_proj = Linear(H * Dh, D, bias and cfg.model_type == "gpt_oss", f"{prefix}.o_proj")
        self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps) if qk_norm else None
        self.eps = cfg.rms_norm_eps
        self.rotary = rotary
        self.spec = AttnSpec(layer_idx=i, scale=Dh ** -0.5, window=cfg.layer_window(i))

    def prepare_for_serving(self) -> None:
        self.merge_qkv()

    def merge_qkv(self) -> bool:
        """Serve q, k and v from one [(H + 2 Hkv) Dh, D] projection (one GEMM or gemv a step):
        plain tensors are concatenated; quantized ones with LUT views become one kernel-side
        weight whose rows keep their own tables (lowbit.kernels.weights.concat_rows); other
        formats stay three projections. Returns whether it merged."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        if self.qkv_proj is not None:
            return False
        merged = merge_linears(parts, f"{self.prefix}.qkv_proj")
        if merged is None:
            return False
        self.qkv_proj = merged
        self.q_proj = self.k_proj = self.v_proj = None
        return True

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:  # [T, (H + 2 Hkv) Dh]
        if self.qkv_proj is not None:
            return self.qkv_proj(x)
        return torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        T = x.shape[0]
        qkv = self._qkv(x)
        pool = layer_pool(batch, self.spec.layer_idx, self.Hkv, self.Dh, qkv)
        call = RopeCall(qkv, self.H, self.Hkv, self.Dh, batch.positions, self.rotary.cos_sin,
                        None if self.q_norm is None else self.q_norm.weight,
                        None if self.k_norm is None else self.k_norm.weight, self.eps,
                        pool, None if pool is None else batch.slot_mapping)
        if pool is not None and batch.mode.is_decode:  # the decode kernel may do the rope op's work
            o = rope_attention(call, batch, self.spec, layer=self.prefix)
        else:
            q, k, v = qk_norm_rope(call, layer=self.prefix)
            o = attention(q, k, v, batch, self.spec, pool)  # [T, H, Dh]
        return self.o_proj(o.reshape(T, self.H * self.Dh))


class DecoderLayer(nn.Module):
    """Pre-norm block; carries the residual separately so that each norm fuses the add."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, D: int, eps: float) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)

    def forward(self, h: torch.Tensor | SlotSum, residual: torch.Tensor | None, batch,
                defer_combine: bool = False):
        """(h, residual) -> (this layer's MLP output, the residual). defer_combine: a sparse
        MoE's output may come back as a SlotSum, which the next add_norm sums in its own
        launch (h may be one here for the same reason)."""
        x, residual = self.input_layernorm.add_norm(h, residual)
        h = self.self_attn(x, batch)
        gate32 = getattr(self.mlp, "_gate32", None) if isinstance(self.mlp, SparseMoE) else None
        if gate32 is not None:  # serving: the norm and the gate may share a launch
            norm, moe = self.post_attention_layernorm, self.mlp
            x, residual, logits, ids, w = norm_gate(h, norm.weight, norm.eps, residual, *gate32,
                                                    spec=moe.spec, bias=moe.e_score_correction_bias,
                                                    layer=f"{moe.experts.prefix}.norm_gate")
            routed = None if ids is None else (ids, w)
            return moe(x, defer_combine=defer_combine, logits=logits, routed=routed), residual
        x, residual = self.post_attention_layernorm.add_norm(h, residual)
        if defer_combine and isinstance(self.mlp, SparseMoE):
            return self.mlp(x, defer_combine=True), residual
        return self.mlp(x), residual


def shared_rotary(cfg: ArchConfig) -> RotaryEmbedding:
    """One rotary table [max_position_embeddings, head_dim] that every layer reads."""
    return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope, table=True)


def softmax_router(cfg: ArchConfig) -> RouterSpec:
    return RouterSpec(top_k=cfg.num_experts_per_tok, norm_topk=cfg.norm_topk_prob)


class Qwen3ForCausalLM(CausalLM):
    qk_norm = True
    supports_cuda_graphs = True  # GQA through the paged attention op (mixtral, gpt-oss inherit)

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__(cfg)
        self.rotary = shared_rotary(cfg)
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            attn = GQAttention(cfg, i, f"{p}.self_attn", self.qk_norm, self.rotary)
            layers.append(DecoderLayer(attn, self.make_mlp(cfg, i, f"{p}.mlp"), cfg.hidden_size,
                                       cfg.rms_norm_eps))
        self._finish(layers)

    def make_mlp(self, cfg: ArchConfig, i: int, prefix: str) -> nn.Module:
        if cfg.moe_layers[i]:
            return SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                             softmax_router(cfg), prefix)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, prefix)
