"""Rotary position embedding: default, linear, llama3 and YaRN frequency schedules.

Shapes: T tokens, H heads, R rotary dims (even), P positions.
`RotaryEmbedding(positions)` gives cos/sin [T, R/2]; `apply_rope(x [T, H, R], cos, sin)`
rotates the two halves of R ("neox" layout: pairs (i, i + R/2)). With `table=True` the
embedding also holds `cos_sin` [P, R] float32 (cos then sin, scaled), computed once at
build time for every position: the fused rope op (lowbit.kernels.rope_op) reads it, so a
step computes no trigonometry. A model builds one such embedding and shares it by all
its layers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.kernels.rope_op import rope_cos_sin


def _yarn_inv_freq(rope: dict, dim: int, base: float, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = float(rope["factor"])
    orig = int(rope.get("original_max_position_embeddings") or max_pos)
    beta_fast = float(rope.get("beta_fast") or 32)
    beta_slow = float(rope.get("beta_slow") or 1)
    attn = rope.get("attention_factor")
    if attn is None:
        ms, ms_all = rope.get("mscale"), rope.get("mscale_all_dim")
        if ms and ms_all:
            attn = yarn_mscale(factor, ms) / yarn_mscale(factor, ms_all)
        else:
            attn = yarn_mscale(factor)

    def corr_dim(n_rot: float) -> float:
        return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 where the original frequency is kept (high-frequency dims)
    return inter * (1 - keep) + extra * keep, float(attn)


def _llama3_inv_freq(rope: dict, inv: torch.Tensor) -> torch.Tensor:
    factor, lo, hi = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    orig = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > orig / lo, inv / factor, inv)
    smooth = (orig / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= orig / hi) & (wavelen <= orig / lo)
    return torch.where(is_mid, mid, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-magnitude correction for a context stretched by `scale`."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base: float, max_pos: int, rope: dict | None = None,
                 table: bool = False) -> None:
        super().__init__()
        rope = rope or {}
        kind = rope.get("rope_type", "default")
        inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self.attention_scaling = 1.0
        if kind == "yarn":
            inv, self.attention_scaling = _yarn_inv_freq(rope, dim, base, max_pos)
        elif kind == "linear":
            inv = inv / float(rope["factor"])
        elif kind == "llama3":
            inv = _llama3_inv_freq(rope, inv)
        elif kind != "default":
            raise LowbitError(f"rope_type {kind!r} is not supported (default, linear, llama3, yarn)")
        self.register_buffer("inv_freq", inv, persistent=False)
        self.max_positions = max_pos
        if table:
            self.register_buffer("cos_sin", rope_cos_sin(inv, self.attention_scaling, max_pos),
                                 persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [T, R/2]
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, R] rotated pairwise (i, i + R/2); computed in float32, returned in x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
