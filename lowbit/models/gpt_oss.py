"""gpt-oss: GQA with q/k/v/o biases and per-head attention sinks, sliding-window and full
layers alternating (layer_types), YaRN rope, and a top-k MoE block with biased experts and
a clamped SwiGLU.

Shapes: T tokens, D hidden, H/Hkv heads, Dh head_dim, E experts, A active, I expert width.
  logits = router(x)                  # [T, E], Linear with bias
  ids    = topk(logits, A)            # [T, A]; weights = softmax over the A chosen logits
  gate, up = x @ W13[e]^T + b13[e]    # [*, I] each, clamped: gate <= L, |up| <= L
  y      = (gate * sigmoid(1.702 gate) * (up + 1)) @ W2[e]^T + b2[e]
Softmax over the chosen logits equals softmax over all, top-k, renormalise, so the shared
router ("softmax", norm_topk) serves.

Expert tensors, three layouts of the same weights:
- transformers (what save_pretrained writes; the in-memory layout): `mlp.experts.gate_up_proj`
  [E, D, 2I] used as x @ W, gate/up INTERLEAVED along the last dim (gate = [..., 0::2],
  up = [..., 1::2]), `gate_up_proj_bias` [E, 2I] interleaved the same way, `down_proj`
  [E, I, D], `down_proj_bias` [E, D]; the router is `mlp.router.{weight,bias}`.
- the published hub checkpoints (openai/gpt-oss-*): MXFP4 `gate_up_proj_blocks`
  [E, 2I, D/32, 16] uint8 (two E2M1 codes a byte, low nibble first) + `gate_up_proj_scales`
  [E, 2I, D/32] uint8 (E8M0, bias 127), rows interleaved gate/up, i.e. already [out, in];
  `down_proj_blocks` [E, D, I/32, 16] + `down_proj_scales` [E, D, I/32]; biases in bf16 as above.
- ours (lowbit.layers.moe.Experts): w13 [E, 2I, D] gate rows then up rows, w2 [E, D, I].
The loaders here de-interleave and transpose dense tensors in the transformers layout. The
MXFP4 payloads never reach them: lowbit.checkpoint.thirdparty (layout "gpt-oss-mxfp4",
chosen by quantization_config) groups `*_blocks` + `*_scales` into one QuantizedTensor,
already [E, 2I, D] with the gate/up rows reordered, named `...experts.gate_up_proj`, and the
sink installs it whole. A bare `_blocks`/`_scales` name reaching `map_mxfp4` means
config.json lacks that quantization_config.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.layers.loading import check_shape
from lowbit.layers.moe import RouterSpec, SparseMoE
from lowbit.models.config import ArchConfig
from lowbit.models.qwen3 import DecoderLayer, GQAttention, Qwen3ForCausalLM, shared_rotary

# mlp.experts.{gate_up_proj,down_proj}[_bias|_blocks|_scales]
_EXPERT_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_TARGET = {("gate_up_proj", ""): "w13", ("gate_up_proj", "_bias"): "b13",
           ("down_proj", ""): "w2", ("down_proj", "_bias"): "b2"}


def gate_up_rows(two_i: int) -> torch.Tensor:
    """Row order that turns interleaved gate/up rows into gate rows then up rows."""
    return torch.cat((torch.arange(0, two_i, 2), torch.arange(1, two_i, 2)))


def load_gate_up(param: torch.Tensor, loaded: torch.Tensor, shard=None, name: str = "") -> None:
    """transformers gate_up_proj [E, D, 2I] (interleaved) -> w13 [E, 2I, D]."""
    w = loaded.transpose(1, 2)  # [E, 2I, D], rows interleaved
    check_shape(name, param.shape, w.shape)
    param.data.copy_(w[:, gate_up_rows(w.shape[1])])


def load_gate_up_bias(param: torch.Tensor, loaded: torch.Tensor, shard=None, name: str = "") -> None:
    """gate_up_proj_bias [E, 2I] (interleaved) -> b13 [E, 2I]."""
    check_shape(name, param.shape, loaded.shape)
    param.data.copy_(loaded[:, gate_up_rows(loaded.shape[1])])


def load_down(param: torch.Tensor, loaded: torch.Tensor, shard=None, name: str = "") -> None:
    """transformers down_proj [E, I, D] -> w2 [E, D, I]."""
    w = loaded.transpose(1, 2)
    check_shape(name, param.shape, w.shape)
    param.data.copy_(w)


class GptOssAttention(GQAttention):
    def __init__(self, cfg: ArchConfig, i: int, prefix: str, rotary) -> None:
        super().__init__(cfg, i, prefix, qk_norm=False, rotary=rotary)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads), requires_grad=False)  # [H]

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        self.spec.sinks = self.sinks  # the live parameter, wherever it has been moved
        return super().forward(x, batch)


class GptOssForCausalLM(Qwen3ForCausalLM):
    def __init__(self, cfg: ArchConfig) -> None:
        super(Qwen3ForCausalLM, self).__init__(cfg)
        self.rotary = shared_rotary(cfg)
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            attn = GptOssAttention(cfg, i, f"{p}.self_attn", self.rotary)
            layers.append(DecoderLayer(attn, self.make_mlp(cfg, i, f"{p}.mlp"), cfg.hidden_size,
                                       cfg.rms_norm_eps))
        self._finish(layers)

    def make_mlp(self, cfg: ArchConfig, i: int, prefix: str) -> nn.Module:
        spec = RouterSpec(top_k=cfg.num_experts_per_tok, scoring="softmax", norm_topk=True)
        moe = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, spec, prefix,
                        gate_bias=True, expert_bias=True, activation="swiglu_oai",
                        limit=cfg.swiglu_limit)
        ex = moe.experts
        ex.w13.weight_loader, ex.b13.weight_loader, ex.w2.weight_loader = load_gate_up, load_gate_up_bias, load_down
        return moe

    def map_name(self, name: str) -> tuple[str, object] | None:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        m = _EXPERT_TENSOR.match(name)
        if m is None:
            return super().map_name(name)
        prefix, proj, part = m.group(1), m.group(2), m.group(3) or ""
        if part in ("_blocks", "_scales"):
            return self.map_mxfp4(prefix, proj, part)
        return f"{prefix}.{_TARGET[proj, part]}", None

    def map_mxfp4(self, prefix: str, proj: str, part: str) -> tuple[str, object] | None:
        """MXFP4 payload names are grouped before map_name (see the module docstring)."""
        raise LowbitError(
            f"{prefix}.{proj}{part} is an MXFP4 payload (the published gpt-oss layout) but "
            "config.json has no quantization_config with quant_method \"mxfp4\"; restore it "
            "from the model's original config.json"
        )
