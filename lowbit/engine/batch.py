"""ForwardBatch: what one model step computes, as a flat token list.

Sequences b = 0..B-1 contribute new tokens query_start[b]:query_start[b+1] of the flat
list; context_lens[b] tokens of sequence b are already in the KV cache (at cache row
cache_slots[b]). A prefill is context_len 0 and many tokens; a decode step is one token
over a long context; chunked prefill is anything between: one shape for all three.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [T] int64, rope positions of the new tokens
    query_start: list[int]  # [B + 1]
    context_lens: list[int]  # [B]
    cache_slots: list[int]  # [B]
    kv_cache: object | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    @classmethod
    def build(cls, new_tokens: list[int], context_lens: list[int], cache_slots: list[int] | None,
              kv_cache=None, device: torch.device | str = "cpu") -> ForwardBatch:
        starts = [0]
        pos: list[int] = []
        for n, c in zip(new_tokens, context_lens):
            starts.append(starts[-1] + n)
            pos.extend(range(c, c + n))
        slots = list(range(len(new_tokens))) if cache_slots is None else cache_slots
        return cls(torch.tensor(pos, dtype=torch.long, device=device), starts, list(context_lens),
                   slots, kv_cache)
