"""Paged KV blocks: a free list, per-request block tables, and prefix caching.

The pool holds `num_total_blocks` blocks of `block_size` token slots. A request's block
table lists the blocks holding its tokens in order. A block that is full of computed
tokens gets a chained hash (its tokens plus the hash of the block before), so a later
request whose prompt starts with the same tokens reuses those blocks instead of
recomputing them. Blocks are reference-counted; a block at count zero is free, but keeps
its cached contents until the allocator hands it out again (least recently freed last).
At idle every block is free: `num_free_blocks == num_total_blocks`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from lowbit.engine.request import Request


def chain_hash(parent: int | None, token_ids: list[int]) -> int:
    """Hash of a full block given the hash of the block before it (None for the first)."""
    return hash((parent, tuple(token_ids)))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: list[int] = field(default_factory=list)  # kept to rule out hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_prefix_hits = 0  # tokens served from the prefix cache, for metrics
        self.num_prefix_queries = 0

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission ------------------------------------------------------------------
    def match_prefix(self, req: Request) -> list[int]:
        """Blocks already holding a prefix of `req`'s tokens. The block of the last token is
        never matched: its logits must be computed, so it is written, so it must be owned."""
        if not self.enable_prefix_caching or req.wants_prompt_logprobs:
            return []
        hits: list[int] = []
        parent = None
        bs = self.block_size
        for i in range((req.num_tokens - 1) // bs):
            tokens = req.token_ids[i * bs:(i + 1) * bs]
            parent = chain_hash(parent, tokens)
            bid = self.cached.get(parent)
            if bid is None or self.blocks[bid].token_ids != tokens:
                break
            hits.append(bid)
        return hits

    def can_allocate(self, cached: list[int], num_tokens: int) -> bool:
        """Can a waiting request take the `cached` blocks plus new ones for `num_tokens`?"""
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        fresh = self.blocks_for(num_tokens) - len(cached)
        return fresh + revived <= self.num_free_blocks

    def allocate(self, req: Request, cached: list[int], num_tokens: int) -> None:
        """Give an empty request the `cached` prefix blocks, then room for `num_tokens`."""
        assert not req.block_table and req.num_computed_tokens == 0
        parent = None
        for i, bid in enumerate(cached):
            self._take(bid)
            parent = chain_hash(parent, req.token_ids[i * self.block_size:(i + 1) * self.block_size])
            req.block_hashes.append(parent)
        req.block_table = list(cached)
        req.num_computed_tokens = req.num_cached_tokens = len(cached) * self.block_size
        self.num_prefix_hits += req.num_cached_tokens
        self.num_prefix_queries += req.num_tokens
        self.append_slot(req, num_tokens)

    # -- growth -----------------------------------------------------------------------
    def may_append(self, req: Request, num_tokens: int) -> bool:
        """Are there free blocks for a running request to hold `num_tokens` tokens?"""
        return self.blocks_for(num_tokens) - len(req.block_table) <= self.num_free_blocks

    def append_slot(self, req: Request, num_tokens: int) -> None:
        """Grow `req`'s block table to hold `num_tokens` tokens."""
        while len(req.block_table) < self.blocks_for(num_tokens):
            req.block_table.append(self._pop_free())

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back the blocks past those that hold `num_tokens` tokens: the slots of
        rejected draft tokens. They were never full of computed tokens, so never cached."""
        keep = self.blocks_for(num_tokens)
        while len(req.block_table) > keep:
            block = self.blocks[req.block_table.pop()]
            assert block.ref_count == 1 and block.hash is None, "a trimmed block is owned and uncached"
            block.ref_count = 0
            self.free_ids[block.block_id] = None
            self.free_ids.move_to_end(block.block_id, last=False)

    def cache_full_blocks(self, req: Request) -> None:
        """Register the blocks that the last step filled with computed tokens."""
        bs = self.block_size
        for i in range(len(req.block_hashes), req.num_computed_tokens // bs):
            tokens = req.token_ids[i * bs:(i + 1) * bs]
            h = chain_hash(req.block_hashes[-1] if req.block_hashes else None, tokens)
            req.block_hashes.append(h)
            block = self.blocks[req.block_table[i]]
            if self.enable_prefix_caching and h not in self.cached and block.hash is None:
                block.hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id

    def free(self, req: Request) -> None:
        """Drop `req`'s references; its last blocks become the first to be reused."""
        for bid in reversed(req.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_ids[bid] = None
                if block.hash is None:  # nothing worth keeping: reuse it first
                    self.free_ids.move_to_end(bid, last=False)
        req.block_table, req.block_hashes = [], []
        req.num_computed_tokens = 0

    # -- internals --------------------------------------------------------------------
    def _take(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free_ids[bid]
        block.ref_count += 1

    def _pop_free(self) -> int:
        bid, _ = self.free_ids.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None and self.cached.get(block.hash) == bid:
            del self.cached[block.hash]
        block.hash, block.token_ids, block.ref_count = None, [], 1
        return bid
