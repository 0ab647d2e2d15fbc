"""Model families: model_type -> class. `build_model(cfg)` makes an empty model of that shape."""

from __future__ import annotations

import importlib

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
