"""Helpers shared by the format tests."""

from __future__ import annotations

import torch

from lowbit.formats import get_format


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def sqnr_db(name: str, w: torch.Tensor, **kw) -> float:
    """Signal-to-quantization-noise ratio of a round trip, in dB."""
    fmt = get_format(name)
    d = fmt.decode(fmt.encode(w, **kw), tuple(w.shape))
    return float(10 * torch.log10(w.pow(2).sum() / (d - w).pow(2).sum()))
