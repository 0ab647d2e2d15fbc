"""Contiguous KV cache: one row of max_len tokens per sequence slot.

Layout per layer: k [slots, max_len, Hkv, Dk], v [slots, max_len, Hkv, Dv], allocated at
the first write (the layer's head dims are known then). The paged cache of the serving
engine offers the same `update` contract.
"""

from __future__ import annotations

import torch


class ContiguousKVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int) -> None:
        self.num_slots, self.max_len = num_slots, max_len
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def update(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store k/v [L, Hkv, D] at positions start..start+L of `slot`; return [start+L, Hkv, D]."""
        if self.k[layer] is None:
            self.k[layer] = k.new_zeros(self.num_slots, self.max_len, *k.shape[1:])
            self.v[layer] = v.new_zeros(self.num_slots, self.max_len, *v.shape[1:])
        end = start + k.shape[0]
        assert end <= self.max_len, "the caller checks lengths against max_len"
        self.k[layer][slot, start:end] = k
        self.v[layer][slot, start:end] = v
        return self.k[layer][slot, :end], self.v[layer][slot, :end]
