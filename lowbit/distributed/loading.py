"""This rank's model: the checkpoint loader given this rank's partition and, on rank 0 of a
world lowbit launched, a DriverModel in front of it.

  load_shard(model, **kwargs)  this rank's part of a checkpoint: load_model's arguments,
                               under init_distributed (a world of 1 loads the whole model)
  engine_model(config)         the model an LLMEngine of `config` runs in this process:
                               None for one process (the engine loads its own); else this
                               rank's shard, and on rank 0 of a launched world a DriverModel
                               once every rank has loaded (lowbit.distributed.driver)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from lowbit.checkpoint.loader import LoadedModel, load_model
from lowbit.config import EngineConfig
from lowbit.distributed import parallel_state as ps
from lowbit.distributed.driver import drive_workers
from lowbit.distributed.sharding import RankPartition
from lowbit.engine.engine import compute_dtype, default_device
from lowbit.errors import LowbitError


def load_shard(model: str | Path, **kwargs) -> LoadedModel:
    """lowbit.checkpoint.loader.load_model for this rank's part of the model."""
    layout = ps.current_layout()
    if layout is None:
        raise LowbitError("load_shard needs this process's rank: call lowbit.distributed.init_distributed "
                          "first (under torchrun, or a process lowbit launched)")
    return load_model(model, partition=RankPartition(layout) if layout.world > 1 else None, **kwargs)


def engine_model(config: EngineConfig) -> LoadedModel | None:
    """What an engine of `config` runs here (see the module docstring); pass it to
    LLM(..., loaded=) or LLMEngine(config, loaded)."""
    if not config.parallel:
        return None
    ps.check_launched(config.tensor_parallel_size, config.expert_parallel_size)
    device = torch.device(config.device or default_device())
    loaded = load_shard(config.model, dtype=compute_dtype(config.dtype, device), device=str(device),
                        random_weights=config.random_weights, config=config.config,
                        quantization=config.quantization)
    return dataclasses.replace(loaded, model=drive_workers(loaded.model))
