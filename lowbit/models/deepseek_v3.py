"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA), DeepSeekMoE with shared
experts, and V3's multi-token-prediction (MTP) layer as an optional draft head.

Shapes: T tokens, D hidden, H heads, Q q_lora_rank, C kv_lora_rank, Dn qk_nope_head_dim,
Dr qk_rope_head_dim, Dv v_head_dim, V vocab.
  q       = q_b_proj(norm(q_a_proj(x)))  or  q_proj(x)  # [T, H, Dn + Dr]
  kv_a    = kv_a_proj_with_mqa(x)                       # [T, C + Dr]: latent, one shared rope key
  c_kv    = kv_a_layernorm(kv_a[:, :C])                 # [T, C]
  k_pe    = rope(kv_a[:, C:])                           # [T, Dr], shared by all heads
  W       = kv_b_proj.weight viewed [H, Dn + Dv, C]:  W_UK = W[:, :Dn], W_UV = W[:, Dn:]
The cache holds c_kv and k_pe only (C + Dr values per token and layer, for all heads), and
attention runs with absorbed weights (lowbit.layers.attention.latent_attention):
  q_lat   = q_nope @ W_UK                               # [T, H, C]: per head, into latent space
  o_lat   = softmax((q_lat . c_kv + q_pe . k_pe) * scale) @ c_kv   # [T, H, C]
  o       = o_lat @ W_UV^T                              # [T, H, Dv] (the op applies it), then o_proj
which equals attention over k = [W_UK c_kv, k_pe], v = W_UV c_kv per head. Every step runs
this form, prefill and extend as well as decode: one code path, and the cache never holds
per-head K/V. (Expanding the latent to per-head K/V would be cheaper for long prefills:
Dn + Dr per head and key instead of C + Dr.) The `latent_attention` op runs every step
on a paged pool through a Triton kernel that reads lengths and tables on the device
(lowbit.kernels.latent; prefill and mixed steps as one query per token over its prefix),
so decode, prefill and mixed steps can each be one CUDA graph; a contiguous cache runs its
torch route.
W is decoded to the compute dtype lazily, at the layer's first forward, and kept (a dense
weight of that dtype is used as it is, no copy): the absorbed products need it per head
and transposed, which no quantized linear kernel reads, and decoding it once per step
would cost a full dequantization per layer per step. Its memory is H * (Dn + Dv) * C
values per layer (V3 in bf16: 32 MiB per layer, about 2 GiB for 61 layers; under tensor
parallelism each rank holds its own H/tp heads). The engine's profiling forward, which
runs before the KV pool is sized, decodes the main layers' W, so the pool leaves room for it.

Rotary layout: checkpoints whose config says rope_interleave (V3's default; V2 always)
rotate the pairs (2i, 2i+1) of the Dr dims. Transformers' V3 writes the rotated values
de-interleaved (evens then odds), its V2 keeps them in place; both apply one fixed
permutation to q and k alike, so q.k is the same. We de-interleave, then rotate halves.

Routing: V3 (noaux_tc) scores experts with a sigmoid, adds e_score_correction_bias for the
choice only, keeps the topk_group best groups (group score: sum of its top two), then the
top-k experts; weights are the unbiased scores, renormalised, times routed_scaling_factor.
V2 scores with a softmax, greedy or group_limited_greedy (group score: its max).

MTP (checkpoint `model.layers.{num_hidden_layers}.*`): the main model's final hidden h_i and
the embedding of token i+1 -> enorm/hnorm -> eh_proj -> one decoder layer ->
shared_head.norm -> the main lm_head gives logits for token i+2. Its embed_tokens and
shared_head.head are copies of the main model's (DeepSeek's weight notes say they are
shared), so they are not loaded twice.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.formats.base import QuantizedTensor
from lowbit.kernels.act_op import silu_mul
from lowbit.kernels.mla_rope_op import MlaRopeCall, latent_pool, mla_rope
from lowbit.kernels.moe_layout import SharedMLP
from lowbit.layers.attention import AttnSpec, latent_attention
from lowbit.layers.linear import Linear
from lowbit.layers.mlp import GatedMLP
from lowbit.layers.moe import RouterSpec, SparseMoE
from lowbit.layers.norm import RMSNorm
from lowbit.layers.rope import RotaryEmbedding, yarn_mscale
from lowbit.models.base import CausalLM
from lowbit.models.config import ArchConfig
from lowbit.models.qwen3 import DecoderLayer, merge_linears

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the default eps, not rms_norm_eps
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_SHARED_WITH_MAIN = ("embed_tokens.weight", "shared_head.head.weight")


def mla_softmax_scale(cfg: ArchConfig) -> float:
    """1/sqrt(Dn + Dr), times mscale(factor, mscale_all_dim)^2 under a scaled rope."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= m * m
    return scale


def mla_rotary(cfg: ArchConfig) -> RotaryEmbedding:
    """One cos/sin table [max_position_embeddings, Dr] that every MLA layer reads."""
    return RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope,
                           table=True)


class MLAttention(nn.Module):
    """The two projections of x (q_proj or q_a_proj, and kv_a_proj_with_mqa) as one merged
    GEMM once `prepare_for_serving` ran; the mla_rope op (kv_a_layernorm, RoPE of q_pe and
    k_pe from the shared table, the latent cache write: one kernel); the absorbed q and o
    products as batched GEMMs over heads reading strided views (no copies); the latent op."""

    def __init__(self, cfg: ArchConfig, i: int, prefix: str, rotary: RotaryEmbedding | None = None) -> None:
        super().__init__()
        H, D, C = cfg.num_heads, cfg.hidden_size, cfg.kv_lora_rank
        self.H, self.Dn, self.Dr, self.Dv, self.C = H, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, C
        self.prefix = prefix
        Dq = self.Dn + self.Dr
        bias = cfg.attention_bias
        self.q_lora = cfg.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = Linear(D, H * Dq, False, f"{prefix}.q_proj")
        else:
            Q = cfg.q_lora_rank
            self.q_a_proj = Linear(D, Q, bias, f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(Q, LORA_NORM_EPS)
            self.q_b_proj = Linear(Q, H * Dq, False, f"{prefix}.q_b_proj")
        self.kv_a_proj_with_mqa = Linear(D, C + self.Dr, bias, f"{prefix}.kv_a_proj_with_mqa")
        self.qkv_a_proj: Linear | None = None  # [first | kv_a] rows, made by merge_projections
        self.kv_a_layernorm = RMSNorm(C, LORA_NORM_EPS)
        self.kv_b_proj = Linear(C, H * (self.Dn + self.Dv), False, f"{prefix}.kv_b_proj")
        self.o_proj = Linear(H * self.Dv, D, bias, f"{prefix}.o_proj")
        self.rotary = mla_rotary(cfg) if rotary is None else rotary
        self.interleaved = cfg.rope_interleave
        self.spec = AttnSpec(layer_idx=i, scale=mla_softmax_scale(cfg))
        self._absorbed: tuple | None = None  # (the weight it came from, dense [H, Dn + Dv, C])

    def prepare_for_serving(self) -> None:
        self.merge_projections()

    def merge_projections(self) -> bool:
        """Serve q_proj (or q_a_proj) and kv_a_proj_with_mqa, which both read x, as one
        projection (one GEMM or gemv a step). Returns whether it merged."""
        if self.qkv_a_proj is not None:
            return False
        name = "q_a_proj" if self.q_lora else "q_proj"
        merged = merge_linears([getattr(self, name), self.kv_a_proj_with_mqa], f"{self.prefix}.qkv_a_proj")
        if merged is None:
            return False
        self.qkv_a_proj = merged
        setattr(self, name, None)
        self.kv_a_proj_with_mqa = None
        return True

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H * Dq] and kv_a [T, C + Dr], as row views of the merged output when merged."""
        if self.qkv_a_proj is not None:
            y = self.qkv_a_proj(x)  # [T, (Q or H * Dq) + C + Dr]
            first, kv_a = y.split([y.shape[-1] - self.C - self.Dr, self.C + self.Dr], dim=-1)
        else:
            first = (self.q_a_proj if self.q_lora else self.q_proj)(x)
            kv_a = self.kv_a_proj_with_mqa(x)
        q = self.q_b_proj(self.q_a_layernorm(first)) if self.q_lora else first
        return q, kv_a

    def absorbed_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """kv_b_proj's weight as dense [H, Dn + Dv, C] in `dtype`, decoded once and kept."""
        w, kept = self.kv_b_proj.weight, self._absorbed
        if kept is None or kept[0] is not w or kept[1].dtype != dtype or kept[1].device != w.device:
            dense = w.dequantize(dtype) if isinstance(w, QuantizedTensor) else w.to(dtype)
            self._absorbed = (w, dense.view(self.H, self.Dn + self.Dv, self.C))
        return self._absorbed[1]

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        T, H, Dn = x.shape[0], self.H, self.Dn
        q, kv_a = self._project(x)  # [T, H * Dq], [T, C + Dr]
        pool = latent_pool(batch, self.spec.layer_idx, self.C, self.Dr, x)
        call = MlaRopeCall(q, kv_a, H, Dn, self.Dr, batch.positions, self.rotary.cos_sin,
                           self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, self.interleaved,
                           pool, None if pool is None else batch.slot_mapping)
        q_pe, c_kv, k_pe = mla_rope(call, layer=self.prefix)  # [T, H, Dr], [T, C], [T, Dr]
        w = self.absorbed_weight(x.dtype)  # [H, Dn + Dv, C]: w_uk = w[:, :Dn], w_uv = w[:, Dn:]
        q_nope = q.view(T, H, Dn + self.Dr)[..., :Dn].transpose(0, 1)  # [H, T, Dn], a strided view
        q_lat = torch.bmm(q_nope, w[:, :Dn]).transpose(0, 1)  # [T, H, C], stored [H, T, C]
        # [T, H, Dv]: W_UV applied by the op (small decode steps: in its reduce launch)
        o = latent_attention(q_lat, q_pe, c_kv, k_pe, batch, self.spec, written=pool is not None, w_uv=w[:, Dn:])
        return self.o_proj(o.reshape(T, H * self.Dv))


class GateUpMLP(GatedMLP):
    """A GatedMLP (the dense layers' MLP, DeepSeekMoE's shared experts) whose gate and up rows
    become one [2S, D] projection at `prepare_for_serving` (one GEMM instead of two) when both
    are plain tensors; gate_proj / up_proj then hold row views of it (no second copy), so the
    moe op's shared-slot layout (lowbit.kernels.moe_layout.SharedMLP) still reads them. The
    merged form runs SiLU(gate) * up through the `act` op (one kernel)."""

    def __init__(self, hidden: int, inter: int, prefix: str) -> None:
        super().__init__(hidden, inter, prefix)
        self.prefix = prefix
        self.gate_up_proj: Linear | None = None

    def prepare_for_serving(self) -> None:
        g, u = self.gate_proj, self.up_proj
        if self.gate_up_proj is not None or not all(isinstance(p.weight, torch.Tensor) for p in (g, u)):
            return  # quantized: a merged copy would double the payload (both stay in use)
        merged = merge_linears([g, u], f"{self.prefix}.gate_up_proj")
        if merged is None or merged.bias is not None:
            return
        S = g.out_features
        g.weight = nn.Parameter(merged.weight[:S], requires_grad=False)
        u.weight = nn.Parameter(merged.weight[S:], requires_grad=False)
        self.gate_up_proj = merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return super().forward(x)
        return self.down_proj(silu_mul(self.gate_up_proj(x), layer=self.prefix))  # [T, 2S] -> [T, S]


def router_spec(cfg: ArchConfig) -> RouterSpec:
    grouped = cfg.topk_method in ("noaux_tc", "group_limited_greedy")
    return RouterSpec(
        top_k=cfg.num_experts_per_tok,
        scoring=cfg.scoring_func,
        norm_topk=cfg.norm_topk_prob,
        n_group=cfg.n_group if grouped else 1,
        topk_group=cfg.topk_group if grouped else 1,
        group_score="top2sum" if cfg.topk_method == "noaux_tc" else "max",
        scaling=cfg.routed_scaling_factor,
    )


def make_mlp(cfg: ArchConfig, i: int, prefix: str) -> nn.Module:
    """Layer i's feed-forward: DeepSeekMoE (routed + shared experts) or a dense gated MLP."""
    moe = cfg.moe_layers[i] if i < cfg.num_layers else cfg.is_moe  # i == num_layers: the MTP layer
    if not moe:
        return GateUpMLP(cfg.hidden_size, cfg.intermediate_size, prefix)
    inter = cfg.moe_intermediate_size
    block = SparseMoE(cfg.hidden_size, cfg.num_experts, inter, router_spec(cfg), prefix,
                      score_bias=cfg.topk_method == "noaux_tc",
                      shared_inter=inter * cfg.num_shared_experts)
    if block.shared_experts is not None:  # the same weights, served through one gate_up GEMM
        block.shared_experts = GateUpMLP(cfg.hidden_size, inter * cfg.num_shared_experts,
                                         f"{prefix}.shared_experts")
        block.shared = SharedMLP(block.shared_experts)
    return block


def decoder_layer(cfg: ArchConfig, i: int, rotary: RotaryEmbedding | None = None) -> DecoderLayer:
    p = f"model.layers.{i}"
    return DecoderLayer(MLAttention(cfg, i, f"{p}.self_attn", rotary), make_mlp(cfg, i, f"{p}.mlp"),
                        cfg.hidden_size, cfg.rms_norm_eps)


class SharedHead(nn.Module):
    def __init__(self, D: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(D, eps)


class MTPLayer(DecoderLayer):
    """A decoder layer (KV-cache slot num_layers) with the MTP input mix and output norm."""

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding | None = None) -> None:
        N, D, eps = cfg.num_layers, cfg.hidden_size, cfg.rms_norm_eps
        p = f"model.layers.{N}"
        super().__init__(MLAttention(cfg, N, f"{p}.self_attn", rotary), make_mlp(cfg, N, f"{p}.mlp"), D, eps)
        self.enorm = RMSNorm(D, eps)
        self.hnorm = RMSNorm(D, eps)
        self.eh_proj = Linear(2 * D, D, False, f"{p}.eh_proj")
        self.shared_head = SharedHead(D, eps)

    def predict(self, hidden: torch.Tensor, emb: torch.Tensor, batch) -> torch.Tensor:
        """hidden [T, D] (main model output at i), emb [T, D] (token i+1) -> [T, D]."""
        x = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(hidden)), dim=-1))  # [T, D]
        h, residual = self(x, None, batch)
        return self.shared_head.norm(h + residual)


class DeepseekV3ForCausalLM(CausalLM):
    supports_cuda_graphs = True  # decode graphs need the latent op's graph-safe decode route
    attention_op = "latent_attention"
    optional_modules = ("mtp",)

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__(cfg)
        if cfg.num_nextn_predict_layers > 1:
            raise LowbitError(
                f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}: lowbit runs at most one "
                "MTP layer; set it to 1 (or 0) in config.json"
            )
        self.rotary = mla_rotary(cfg)
        self._finish([decoder_layer(cfg, i, self.rotary) for i in range(cfg.num_layers)])
        self.mtp = MTPLayer(cfg, self.rotary) if cfg.num_nextn_predict_layers else None
        self.requires_grad_(False)

    @property
    def num_cache_layers(self) -> int:
        return self.config.num_layers + (self.mtp is not None)

    def mtp_forward(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, batch) -> torch.Tensor:
        """Draft logits [T, V] for the token after next: hidden [T, D] is this model's forward
        output at positions p, next_token_ids [T] the tokens at p + 1; batch carries positions p
        and a KV cache with num_cache_layers slots."""
        if self.mtp is None:
            raise LowbitError("this checkpoint has no MTP layer (num_nextn_predict_layers tensors)")
        emb = self.model.embed_tokens(next_token_ids)  # [T, D]
        return self.compute_logits(self.mtp.predict(hidden, emb, batch))

    def map_name(self, name: str) -> tuple[str, object] | None:
        m = _LAYER.match(name)
        if m and int(m.group(1)) == self.config.num_layers and self.config.num_nextn_predict_layers:
            if m.group(2) in _SHARED_WITH_MAIN:
                return None
            name = f"mtp.{m.group(2)}"
        name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
        return super().map_name(name)
