"""Tensor and expert parallelism over torch.distributed: process groups, sharded layers,
this rank's model (loading.py), and the driver/worker launcher. It wraps a loaded model or
an engine from outside: nothing below it (checkpoint, engine, models) imports it.
docs/DISTRIBUTED.md is the guide."""

from lowbit.distributed.loading import engine_model, load_shard
from lowbit.distributed.parallel_state import (
    ParallelLayout,
    current_layout,
    destroy_distributed,
    init_distributed,
)
from lowbit.distributed.sharding import RankPartition, shard_model

__all__ = ["ParallelLayout", "RankPartition", "current_layout", "destroy_distributed", "engine_model",
           "init_distributed", "load_shard", "shard_model"]
