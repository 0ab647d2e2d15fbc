"""Qwen3 (dense) and Qwen3-MoE: GQA with per-head RMSNorm on q and k (QK-norm), RoPE,
and either a gated MLP or a softmax top-k MoE block per layer.

Shapes: T tokens, D hidden, H/Hkv heads, Dh head_dim.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.layers.attention import AttnSpec, attention
from lowbit.layers.linear import Linear
from lowbit.layers.mlp import GatedMLP
from lowbit.layers.moe import RouterSpec, SparseMoE
from lowbit.layers.norm import RMSNorm
from lowbit.layers.rope import RotaryEmbedding, apply_rope
from lowbit.models.base import CausalLM
from lowbit.models.config import ArchConfig


class GQAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, i: int, prefix: str, qk_norm: bool) -> None:
        super().__init__()
        H, Hkv, Dh, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.H, self.Hkv, self.Dh = H, Hkv, Dh
        bias = cfg.attention_bias
        self.q_proj = Linear(D, H * Dh, bias, f"{prefix}.q_proj")
        self.k_proj = Linear(D, Hkv * Dh, bias, f"{prefix}.k_proj")
        self.v_proj = Linear(D, Hkv * Dh, bias, f"{prefix}.v_proj")
        self.o_proj = Linear(H * Dh, D, bias and cfg.model_type == "gpt_oss", f"{prefix}.o_proj")
        self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = RotaryEmbedding(Dh, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope)
        self.spec = AttnSpec(layer_idx=i, scale=Dh ** -0.5, window=cfg.layer_window(i))

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.H, self.Dh)
        k = self.k_proj(x).view(T, self.Hkv, self.Dh)
        v = self.v_proj(x).view(T, self.Hkv, self.Dh)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rotary(batch.positions)  # [T, Dh/2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attention(q, k, v, batch, self.spec)  # [T, H, Dh]
        return self.o_proj(o.reshape(T, self.H * self.Dh))


class DecoderLayer(nn.Module):
    """Pre-norm block; carries the residual separately so norms can fuse the add later."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, D: int, eps: float) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, batch):
        residual = h if residual is None else h + residual
        h = self.self_attn(self.input_layernorm(residual), batch)
        residual = h + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


def softmax_router(cfg: ArchConfig) -> RouterSpec:
    return RouterSpec(top_k=cfg.num_experts_per_tok, norm_topk=cfg.norm_topk_prob)


class Qwen3ForCausalLM(CausalLM):
    qk_norm = True
    supports_cuda_graphs = True  # GQA through the paged attention op (mixtral, gpt-oss inherit)

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__(cfg)
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            attn = GQAttention(cfg, i, f"{p}.self_attn", self.qk_norm)
            layers.append(DecoderLayer(attn, self.make_mlp(cfg, i, f"{p}.mlp"), cfg.hidden_size,
                                       cfg.rms_norm_eps))
        self._finish(layers)

    def make_mlp(self, cfg: ArchConfig, i: int, prefix: str) -> nn.Module:
        if cfg.moe_layers[i]:
            return SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                             softmax_router(cfg), prefix)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, prefix)
