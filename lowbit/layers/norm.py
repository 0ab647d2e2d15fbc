"""RMSNorm, computed in float32 and cast back (the convention of the HF reference models),
through the `norm` op (lowbit.kernels.norm_op): one kernel for the norm, and for the
residual add fused in front of it.

Shapes: T tokens, D features (any leading dims normalize over the last one).
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.kernels.norm_op import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)[0]

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); residual None (the first layer): (norm(x), x)."""
        return rms_norm(x, self.weight, self.eps, residual)
