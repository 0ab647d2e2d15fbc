"""Mixtral: Qwen3-MoE's shape without QK-norm; top-2 of 8 softmax routing with the two
weights renormalised; optional sliding window. Checkpoint names differ
(`block_sparse_moe`, experts w1/w3/w2), mapped here onto the shared layers."""

from __future__ import annotations

from torch import nn

from lowbit.layers.moe import RouterSpec, SparseMoE
from lowbit.models.config import ArchConfig
from lowbit.models.qwen3 import Qwen3ForCausalLM


class MixtralForCausalLM(Qwen3ForCausalLM):
    qk_norm = False

    def make_mlp(self, cfg: ArchConfig, i: int, prefix: str) -> nn.Module:
        return SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.intermediate_size,
                         RouterSpec(top_k=cfg.num_experts_per_tok, norm_topk=True), prefix)

    def map_name(self, name: str):
        return super().map_name(name.replace(".block_sparse_moe.", ".mlp."))
