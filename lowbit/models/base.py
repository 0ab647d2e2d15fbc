"""What every model family shares: the causal-LM shell and strict weight loading.

A family subclasses `CausalLM`, builds `self.model.layers` from lowbit.layers, and maps
checkpoint names to parameters in `map_name` (name -> (param_name, shard) or None to
skip). Loading is strict: a tensor with no parameter, a parameter no tensor filled, or a
shape mismatch raises LowbitError naming the tensor. The one exception is a submodule
named in `optional_modules` (a draft head such as DeepSeek's MTP layer): a checkpoint may
omit it entirely, and then it is dropped (set to None); a partial one is still an error.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.kernels.linear_op import linear
from lowbit.layers.loading import default_loader
from lowbit.layers.norm import RMSNorm
from lowbit.models.config import ArchConfig

# per-expert checkpoint names -> stacked expert parameters
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_HALF = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}
# the fused layout transformers keeps in memory: gate_up_proj [E, 2I, D], down_proj [E, D, I]
_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


class Body(nn.Module):
    def __init__(self, cfg: ArchConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    skip_patterns: tuple[str, ...] = (r"rotary_emb\.inv_freq$",)
    optional_modules: tuple[str, ...] = ()  # attribute names of submodules a checkpoint may omit

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.config = cfg

    def _finish(self, layers: list[nn.Module]) -> None:
        cfg = self.config
        self.model = Body(cfg, layers)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, batch) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, D]."""
        h = self.model.embed_tokens(input_ids)
        residual = None
        for layer in self.model.layers:  # a MoE's output may stay unsummed until the next norm
            h, residual = layer(h, residual, batch, defer_combine=True)
        return self.model.norm.add_norm(h, residual)[0]

    def prepare_for_serving(self) -> None:
        """Once, after loading: every module lays its weights out the way the serving path
        reads them (merged projections, a float32 router gate). The reference forward
        without it computes the same values."""
        for mod in list(self.modules()):
            if mod is not self and hasattr(mod, "prepare_for_serving"):
                mod.prepare_for_serving()

    @property
    def num_cache_layers(self) -> int:
        """KV-cache layer slots the model writes (a draft head adds its own)."""
        return self.config.num_layers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, w, None, layer="lm_head").float()

    # -- loading ---------------------------------------------------------------------
    def map_name(self, name: str) -> tuple[str, object] | None:
        """Checkpoint tensor name -> (parameter name, shard); None skips the tensor."""
        if any(re.search(p, name) for p in self.skip_patterns):
            return None
        m = _EXPERT.match(name)
        if m:
            prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
            if proj in _HALF:
                return f"{prefix}.w13", (int(e), _HALF[proj])
            return f"{prefix}.w2", (int(e), None)
        m = _FUSED.match(name)
        if m:
            return f"{m.group(1)}.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}", None
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: some checkpoints still store it
        return name, None

    def expected_shards(self, pname: str, param: torch.Tensor) -> int:
        """How many load calls fill `pname` completely (expert stacks load piecewise)."""
        if pname.endswith(".w13"):
            return 2 * param.shape[0]
        if pname.endswith(".w2") and ".experts" in pname:
            return param.shape[0]
        return 1

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], sink=None) -> None:
        """Fill every parameter from (checkpoint name, tensor) pairs. With `sink`, each
        tensor goes to sink(pname, param, tensor, shard, name, complete) instead of the
        parameter's loader (the model may live on the meta device; the tensor may be a
        QuantizedTensor); `complete` says this was the parameter's last shard."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for name, tensor in weights:
            target = self.map_name(name)
            if target is None:
                continue
            pname, shard = target
            param = params.get(pname)
            if param is None:
                raise LowbitError(
                    f"checkpoint tensor {name!r} has no place in the {self.config.model_type} model "
                    f"(looked for parameter {pname!r}); the checkpoint does not match config.json"
                )
            loader = getattr(param, "weight_loader", default_loader)
            # shard None: the tensor fills the whole parameter (the loader may re-lay it out)
            whole = self.expected_shards(pname, param) if shard is None else 1
            filled[pname] = filled.get(pname, 0) + whole
            if sink is not None:
                sink(pname, param, tensor, shard, name, filled[pname] >= self.expected_shards(pname, param))
                continue
            loader(param, tensor.to(param.dtype), shard, name)
        for mod in self._absent_optional(filled):
            params = {n: p for n, p in params.items() if not n.startswith(f"{mod}.")}
            setattr(self, mod, None)
        missing = [n for n, p in params.items() if filled.get(n, 0) < self.expected_shards(n, p)]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise LowbitError(
                f"checkpoint is missing tensors for: {', '.join(missing[:5])}{more}"
            )

    def _absent_optional(self, filled: dict[str, int]) -> list[str]:
        """Optional submodules the checkpoint held no tensor for."""
        return [m for m in self.optional_modules if getattr(self, m, None) is not None
                and not any(n.startswith(f"{m}.") for n in filled)]
