"""Model families: model_type -> class. `build_model(cfg)` makes an empty model of that shape."""

from __future__ import annotations

import importlib

import torch

from lowbit.errors import LowbitError
from lowbit.models.config import SUPPORTED, ArchConfig

# model_type -> (module, class)
_FAMILIES = {
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("qwen3", "Qwen3ForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "deepseek_v2": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
}
assert set(_FAMILIES) == set(SUPPORTED)


def model_class(model_type: str):
    if model_type not in _FAMILIES:
        raise LowbitError(f"unknown architecture {model_type!r}; lowbit supports {', '.join(_FAMILIES)}")
    mod, cls = _FAMILIES[model_type]
    return getattr(importlib.import_module(f"lowbit.models.{mod}"), cls)


def build_model(cfg: ArchConfig):
    """Allocate the model for `cfg` (parameters uninitialised; use torch.device to place it)."""
    return model_class(cfg.model_type)(cfg)


def param_counts(cfg: ArchConfig) -> tuple[int, int]:
    """(total, active per token) parameter counts of `cfg`'s model, from the shapes alone."""
    with torch.device("meta"):
        model = build_model(cfg)
    total = active = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if ".experts." in name and cfg.num_experts:
            n = n * cfg.num_experts_per_tok // cfg.num_experts
        active += n
    return total, active
