"""Dense gated MLP: down(act(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from lowbit.layers.linear import Linear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, prefix: str = "", bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias, f"{prefix}.gate_proj")
        self.up_proj = Linear(hidden, inter, bias, f"{prefix}.up_proj")
        self.down_proj = Linear(inter, hidden, bias, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
