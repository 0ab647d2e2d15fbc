"""How checkpoint tensors land in parameters.

Each parameter carries a `weight_loader(param, tensor, shard)`; `shard` is None for a
whole tensor, or names a slice (an expert index, gate/up half). Loaders check shapes and
raise LowbitError naming the checkpoint tensor and both shapes.
"""

from __future__ import annotations

import torch

from lowbit.errors import LowbitError


def check_shape(name: str, expected: tuple, got: tuple) -> None:
    if tuple(expected) != tuple(got):
        raise LowbitError(
            f"tensor {name!r} has shape {tuple(got)} in the checkpoint but the model expects "
            f"{tuple(expected)}; the checkpoint does not match config.json"
        )


def default_loader(param: torch.Tensor, loaded: torch.Tensor, shard=None, name: str = "") -> None:
    check_shape(name, param.shape, loaded.shape)
    param.data.copy_(loaded)


def expert_loader(param: torch.Tensor, loaded: torch.Tensor, shard=None, name: str = "") -> None:
    """param [E, R, C]. shard: None (whole stack), (e, None) one expert, (e, h) half h of
    the rows of expert e (h = 0 gate, 1 up for a stacked gate+up weight)."""
    if shard is None:
        default_loader(param, loaded, None, name)
        return
    e, half = shard
    dst = param.data[e]
    if half is not None:
        rows = dst.shape[0] // 2
        dst = dst[half * rows:(half + 1) * rows]
    check_shape(name, dst.shape, loaded.shape)
    dst.copy_(loaded)
