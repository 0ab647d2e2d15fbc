"""Build a model and fill it: from an HF directory, or with seeded random weights."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowbit.checkpoint.hf import CheckpointReader, read_generation_config, resolve_model_dir
from lowbit.errors import LowbitError
from lowbit.models import build_model
from lowbit.models.config import ArchConfig, load_config

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ArchConfig
    path: Path | None
    generation_config: dict = field(default_factory=dict)
    weight_format: str = "bf16"


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise LowbitError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def allocate(cfg: ArchConfig, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    with default_dtype(dtype), torch.device(device):
        return build_model(cfg).eval()


def random_init_(model: torch.nn.Module, seed: int = 0) -> None:
    """Seeded weights that keep activations finite at any depth: matrices ~ N(0, 1/fan_in)/2,
    norms 1, biases and router score biases 0."""
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.data.normal_(0.0, 0.5 / math.sqrt(p.shape[-1]), generator=g)
        elif name.endswith("norm.weight") or "layernorm" in name or name.endswith("norm"):
            p.data.fill_(1.0)
        else:
            p.data.zero_()


def load_model(model: str | Path, *, dtype: str | torch.dtype = "bfloat16", device: str = "cpu",
               random_weights: bool = False, config: str | Path | None = None,
               seed: int = 0) -> LoadedModel:
    """`model` is a built-in name or an HF directory; with random_weights, `config` (a
    config.json) alone decides the shape and no checkpoint is read."""
    dt = parse_dtype(dtype)
    if random_weights:
        if config is None:
            raise LowbitError("--random-weights needs --config FILE (a model's config.json)")
        cfg = load_config(config)
        m = allocate(cfg, dt, device)
        random_init_(m, seed)
        return LoadedModel(m, cfg, None, {}, f"{SHORT[dt]} (random)")
    path = resolve_model_dir(model)
    cfg = load_config(path)
    reader = CheckpointReader(path)
    m = allocate(cfg, dt, device)
    m.load_weights(reader.tensors(desc=f"loading {path.name}"))
    gen = read_generation_config(path)
    return LoadedModel(m, cfg, path, gen, reader.storage_format())
