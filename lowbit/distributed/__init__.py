"""Tensor and expert parallelism over torch.distributed: process groups, sharded layers,
sharded loading, and the driver/worker launcher. docs/DISTRIBUTED.md is the guide."""

from lowbit.distributed.parallel_state import (
    ParallelLayout,
    current_layout,
    destroy_distributed,
    init_distributed,
)
from lowbit.distributed.sharding import shard_model

__all__ = ["ParallelLayout", "current_layout", "destroy_distributed", "init_distributed", "shard_model"]
