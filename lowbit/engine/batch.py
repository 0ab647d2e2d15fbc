"""ForwardBatch: what one model step computes, as a flat token list.

Sequences b = 0..B-1 contribute new tokens query_start[b]:query_start[b+1] of the flat
list; context_lens[b] tokens of sequence b are already in the KV cache, at `cache_slots[b]`
(a row index for the contiguous cache, a `SeqSlots` block table for the paged one). A
prefill is context_len 0 and many tokens; a decode step is one token over a long context;
chunked prefill is anything between: one shape for all three. The paged engine also fills
`slot_mapping` (pool row of each new token) and `block_tables`, the metadata that fused
attention and KV-write kernels read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardMode(enum.Enum):
    PREFILL = "prefill"  # every sequence starts from an empty cache
    DECODE = "decode"  # one new token per sequence
    MIXED = "mixed"  # anything else: chunked prefill, prefill beside decode

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [T] int64, rope positions of the new tokens
    query_start: list[int]  # [B + 1]
    context_lens: list[int]  # [B]
    cache_slots: list  # [B] where each sequence's cache lives
    kv_cache: object | None = None
    slot_mapping: torch.Tensor | None = None  # [T] int64 pool row of each new token
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor | None = None  # [B] int32, context + new tokens
    query_start_dev: torch.Tensor | None = None  # [B + 1] int32, query_start on the device

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    @property
    def mode(self) -> ForwardMode:
        if not any(self.context_lens):
            return ForwardMode.PREFILL
        if self.num_tokens == self.num_seqs and all(self.context_lens):
            return ForwardMode.DECODE
        return ForwardMode.MIXED

    @classmethod
    def build(cls, new_tokens: list[int], context_lens: list[int], cache_slots: list | None,
              kv_cache=None, device: torch.device | str = "cpu") -> ForwardBatch:
        starts = [0]
        pos: list[int] = []
        for n, c in zip(new_tokens, context_lens):
            starts.append(starts[-1] + n)
            pos.extend(range(c, c + n))
        slots = list(range(len(new_tokens))) if cache_slots is None else cache_slots
        return cls(torch.tensor(pos, dtype=torch.long, device=device), starts, list(context_lens),
                   slots, kv_cache)
