"""Linear layer whose weight is a bf16/fp32 tensor or a QuantizedTensor.

Shapes: T tokens, K in_features, N out_features. weight [N, K] (row n is output n),
the HF convention, so checkpoints load without transposes.
The matmul goes through `lowbit.kernels.linear`, which picks a route (a Triton kernel
reading the packed payload, or the torch reference) and counts which one ran.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.formats.base import QuantizedTensor
from lowbit.kernels.linear_op import linear
from lowbit.layers.loading import default_loader


def set_quantized(module: nn.Module, attr: str, qt: QuantizedTensor) -> None:
    """Replace parameter `attr` of `module` by a QuantizedTensor of the same logical shape.
    The tensor becomes a plain attribute: it leaves named_parameters() and module.to()."""
    old = module._parameters.get(attr)
    if old is None:
        raise AssertionError(f"{type(module).__name__} has no parameter {attr!r} to quantize")
    assert tuple(old.shape) == qt.shape, f"{attr}: {tuple(old.shape)} != {qt.shape}"
    del module._parameters[attr]
    setattr(module, attr, qt)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, prefix: str = "") -> None:
        super().__init__()
        self.in_features, self.out_features, self.prefix = in_features, out_features, prefix
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = default_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = default_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, K] -> [T, N]
        return linear(x, self.weight, self.bias, layer=self.prefix)

    def set_quantized_weight(self, qt: QuantizedTensor) -> None:
        """Hold the weight in a format from now on (`self.weight` is the QuantizedTensor)."""
        set_quantized(self, "weight", qt)

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, bias={self.bias is not None}"
