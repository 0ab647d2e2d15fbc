"""A draft model's chained forwards as one step over static device buffers, captured as a
CUDA graph per (rows bucket, chained forwards, sampler mode).

Shape legend: R rows of the bucket (drafting sequences, padded), N chained forwards (k - 1:
draft 0 comes from the catch-up forward before the chain), W block-table width, V vocabulary.

The chain of lowbit.engine.speculative.ModelDrafter, eagerly, runs N single-token forwards
of the draft model, each with its metadata built on the host (positions, slot mapping,
block tables, sequence lengths: a few small host-to-device copies) and a few hundred kernel
launches: on an H100 the demo-draft chain made speculation 0.09x of plain decoding. Here
the chain reads four static buffers, filled once per step:
  ids     [R] int64  draft 0's tokens (a device copy of what the catch-up sampled)
  pos     [R] int64  the position draft 0 is written at
  tables  [R, W]     int32 block tables (the draft pool shares the target's block ids)
  rows    [R] int64  sampler rows
and step j computes its metadata on the device: position p = pos + j, slot
tables[r, p // bs] * bs + p % bs, sequence length p + 1; draft j + 1 (the sampler's step
p + 1, the token's index) comes from lowbit.engine.acceptance.draft_tokens and feeds step
j + 1. The outputs:
tokens [N, R] and, for a random sampler mode, the draft distributions q [N, R, V].

The catch-up can be in the graph too (`catch` = W > 0): in decode state every drafting
row's catch-up is its last step's accepted tokens plus one, at most k + 1, at the positions
just before draft 0's. Each row then feeds W tokens (2, 4 or 8: the least that holds every
row's catch-up), front-padded:
  cids    [R, W] int64  the catch-up tokens, right-aligned (padding first); a buffer per W
  count   [R] int64     real catch-up tokens per row
and the catch-up forward is one prefill-shaped step of R W tokens at positions pos - W ..
pos - 1, sequence length pos: a padding token sits at a position the pool
already holds, so it attends to real entries and is attended to by none (causal), and its KV
write goes to the scratch block instead of over the real entry; draft 0 comes from the logits
at each row's last token, always real. The prefill attention route must be graph-safe
(lowbit.engine.prefill_graphs), else the catch-up stays eager before the chain.

Padded rows (bucket > drafting rows): token 0 at position 0 (W with a catch-up) over the pool's scratch block,
sampling in the sampler's scratch row; their drafts are dropped. Drafts are proposals, so a
chain that drafted badly costs acceptance, never output: the verify step decides.

A bucket is captured at its first chain, after a warm-up under torch's sync debug mode
"error" (lowbit.engine.cuda_graphs.sync_free_warm_up): a draft model whose forward reads
device values on the host keeps the eager chain, with a WARNING. On the CPU `run` is the
same chain eagerly with the host-built metadata the torch routes read (host lengths, cache
slots); `static_batch` is what a graph reads, equal to it on the device (tests).
"""

from __future__ import annotations

import itertools
import logging

import torch

from lowbit.engine.acceptance import draft_tokens
from lowbit.engine.batch import ForwardBatch
from lowbit.engine.cuda_graphs import graph_buckets, sync_free_warm_up
from lowbit.engine.paged_cache import PagedKVCache, SeqSlots
from lowbit.engine.staging import to_device

log = logging.getLogger("lowbit")


def flat_batch(entries: list[tuple[list[int], int, int]], kv_cache: PagedKVCache,
               device: torch.device) -> ForwardBatch:
    """A ForwardBatch over `kv_cache` for (block table, start, new tokens) entries, with the
    metadata the runner stages for the target (positions, slot mapping, tables, lengths)."""
    bs = kv_cache.block_size
    pos: list[int] = []
    slots: list[int] = []
    starts = [0]
    for table, start, n in entries:
        pos += range(start, start + n)
        slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        starts.append(starts[-1] + n)
    width = max(len(t) for t, _, _ in entries)
    tables = torch.full((len(entries), width), kv_cache.scratch_block, dtype=torch.int32)
    for i, (table, _, _) in enumerate(entries):
        tables[i, :len(table)] = torch.as_tensor(table, dtype=torch.int32)
    as_dev = lambda v, dt=torch.long: to_device(v, device, dt)
    return ForwardBatch(as_dev(pos), starts, [s for _, s, _ in entries],
                        [SeqSlots.build(t, s, n, bs, device) for t, s, n in entries], kv_cache,
                        as_dev(slots), tables.to(device, non_blocking=True), as_dev([s + n for _, s, n in entries], torch.int32))


PAD_WIDTHS = (2, 4, 8)  # tokens a row of a captured catch-up or MTP follow-up (k + 1 <= 8)


def pad_width(m: int) -> int | None:
    """The least of PAD_WIDTHS that holds m tokens, None past the last."""
    return next((w for w in PAD_WIDTHS if w >= m), None)


def front_padded_batch(end: torch.Tensor, count: torch.Tensor, tables: torch.Tensor, width: int,
                       starts: torch.Tensor, kv_cache: PagedKVCache) -> ForwardBatch:
    """A prefill-shaped batch of `width` tokens a row, computed on the device: row r's tokens at
    positions end[r] - width .. end[r] - 1, of which the last count[r] are real; the padding's
    KV writes go to the scratch block (it sits at positions the pool already holds). Host lists
    are the prefill graphs' placeholders: the graph-safe routes read the device tensors only."""
    b, bs = len(end), kv_cache.block_size
    pos = end[:, None] - width + torch.arange(width, device=end.device)  # [b, width]
    real = torch.arange(width, device=end.device) >= width - count[:, None]
    slots = tables.gather(1, pos.clamp(min=0) // bs).long() * bs + pos % bs
    slots = torch.where(real, slots, kv_cache.scratch_block * bs + pos % bs)
    return ForwardBatch(pos.reshape(-1), [0] + [b * width] * b, [0] * b, [None] * b, kv_cache,
                        slots.reshape(-1), tables, end.to(torch.int32), query_start_dev=starts)


def capture_step(owner, key: tuple, step, sampling, what: str) -> str | None:
    """Capture step() as owner.graphs[key] (outputs in owner.outputs[key], the memory pool
    owner.pool shared by its graphs), after a sync-free warm-up; None, or why it cannot be."""
    reason = sync_free_warm_up(owner.device, sampling, step, what)
    if reason is not None:
        return reason
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=owner.pool):
        owner.outputs[key] = step()
    owner.pool = graph.pool()
    owner.graphs[key] = graph
    torch.cuda.synchronize(owner.device)
    log.info("captured the CUDA graph of %s", what)
    return None


class DraftChainGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache, max_rows: int, max_blocks: int,
                 device: torch.device, capture: bool) -> None:
        self.model, self.kv_cache, self.device, self.capture_on = model, kv_cache, device, capture
        self.buckets = graph_buckets(max_rows)
        r = self.buckets[-1]
        self.ids = torch.zeros(r, dtype=torch.long, device=device)
        self.pos = torch.zeros(r, dtype=torch.long, device=device)
        self.rows = torch.zeros(r, dtype=torch.long, device=device)
        self.tables = torch.full((r, max_blocks), kv_cache.scratch_block, dtype=torch.int32, device=device)
        # the catch-up's buffers: per width, made at its first stage and never freed (a captured
        # graph keeps reading the ones it was captured with)
        self.count = torch.zeros(r, dtype=torch.long, device=device)
        self.cids: dict[int, torch.Tensor] = {}  # width -> [r, width] int64
        self.starts: dict[int, torch.Tensor] = {}  # width -> [r + 1] int32
        self.catch_host: list[tuple[list[int], int, int]] = []  # eager catch-up entries (table, start, n)
        self.catch_ids: list[int] = []
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.eager: dict[tuple, str] = {}
        self.pool = None
        self.replays = 0

    def bucket_for(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def stage(self, tokens: torch.Tensor | None, pos: list[int], tables: list[list[int]], rows: torch.Tensor,
              sampling) -> int:
        """Fill the static buffers for len(pos) drafting rows (padded to their bucket when
        chains are captured); returns the rows the chain runs. tokens: draft 0 (None: a staged
        catch-up makes it)."""
        n = len(pos)
        b = self.bucket_for(n) if self.capture_on else n
        self.host = list(zip(tables, pos))
        width = self.tables.shape[1]
        if any(len(t) > width for t in tables):
            raise AssertionError("a block table is wider than the draft chain's buffers")
        host = torch.full((b, width), self.kv_cache.scratch_block, dtype=torch.int32)
        for i, t in enumerate(tables):
            host[i, :len(t)] = torch.as_tensor(t, dtype=torch.int32)
        pad = b - n
        self.tables[:b].copy_(host, non_blocking=True)
        self.pos[:b].copy_(torch.as_tensor(pos + [0] * pad, dtype=torch.long), non_blocking=True)
        if tokens is not None:
            self.ids[:n].copy_(tokens)
            self.ids[n:b].zero_()
        self.rows[:n].copy_(rows)
        self.rows[n:b].fill_(sampling.scratch_row)
        return b

    def stage_catch_up(self, b: int, entries: list[tuple[list[int], int, int]], ids: list[list[int]],
                       width: int) -> None:
        """The catch-up of the rows stage() just filled: per row (table, start, n) with n <= width
        real tokens ids ending at the row's draft-0 position. Padded rows get `width` tokens over
        the scratch block (position `width`, so that no position is negative)."""
        n = len(entries)
        if width not in self.cids:
            r = self.buckets[-1]
            self.cids[width] = torch.zeros(r, width, dtype=torch.long, device=self.device)
            self.starts[width] = torch.arange(r + 1, dtype=torch.int32, device=self.device) * width
        host = torch.zeros(b, width, dtype=torch.long)
        for i, row in enumerate(ids):
            host[i, width - len(row):] = torch.as_tensor(row, dtype=torch.long)
        self.cids[width][:b].copy_(host, non_blocking=True)
        self.count[:b].copy_(torch.as_tensor([e[2] for e in entries] + [width] * (b - n), dtype=torch.long),
                             non_blocking=True)
        self.pos[n:b].fill_(width)
        self.catch_host, self.catch_ids = entries, [t for row in ids for t in row]

    def catch_up_batch(self, b: int, width: int) -> ForwardBatch:
        """The catch-up's metadata on the device (what a graph replays): row r's W tokens at
        pos - W .. pos - 1, real from index W - count on, the padding written to the scratch
        block. Host lists are the prefill graphs' placeholders (no route reads them)."""
        return front_padded_batch(self.pos[:b], self.count[:b], self.tables[:b], width,
                                  self.starts[width][:b + 1], self.kv_cache)

    def static_batch(self, b: int, j: int) -> ForwardBatch:
        """Chain step j's metadata, computed on the device from the static buffers (what a
        graph replays; the graph-safe routes read only these tensors)."""
        bs = self.kv_cache.block_size
        tables = self.tables[:b]
        pos = self.pos[:b] + j
        slots = tables.gather(1, (pos // bs)[:, None])[:, 0].long() * bs + pos % bs
        return ForwardBatch(pos, list(range(b + 1)), [1] * b, [None] * b, self.kv_cache, slots, tables,
                            (pos + 1).to(torch.int32))

    def _step(self, b: int, n: int, mode, sampling, graph: bool,
              catch: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chain: n forwards of the draft model over the staged rows; (tokens [n, b], q [n, b, V]
        or None). `graph`: the static batch; else (eager) the host-built one of the eager chain,
        which the torch routes need (host lengths, cache slots). `catch` (W): the staged
        catch-up first, its draft 0 the chain's first token and the outputs' row 0 ([n + 1, b])."""
        ids, rows = self.ids[:b], self.rows[:b]
        toks, qs = [], []
        if catch:
            if graph:
                hidden = self.model(self.cids[catch][:b].reshape(-1), self.catch_up_batch(b, catch))[catch - 1::catch]
            else:
                last = to_device(self.catch_up_last(), self.device)
                ids0 = to_device(self.catch_ids, self.device)
                hidden = self.model(ids0, flat_batch(self.catch_host, self.kv_cache, self.device))[last]
            ids, q = draft_tokens(self.model.compute_logits(hidden), sampling, rows, self.pos[:b], mode)
            toks.append(ids)
            if q is not None:
                qs.append(q)
        for j in range(n):
            batch = (self.static_batch(b, j) if graph else
                     flat_batch([(t, p + j, 1) for t, p in self.host], self.kv_cache, self.device))
            logits = self.model.compute_logits(self.model(ids, batch))
            ids, q = draft_tokens(logits, sampling, rows, self.pos[:b] + (j + 1), mode)
            toks.append(ids)
            if q is not None:
                qs.append(q)
        return torch.stack(toks), (torch.stack(qs) if qs else None)

    def catch_up_last(self) -> list[int]:
        """Each real row's last catch-up token in the eager catch-up's flat token list."""
        return [x - 1 for x in itertools.accumulate(n for _, _, n in self.catch_host)]

    def run(self, b: int, n: int, mode, sampling, catch: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The staged chain (after the staged catch-up with `catch`): a graph replay where one is
        (or can now be) captured, else eagerly."""
        key = (b, n, mode, catch)
        if self.capture_on and key not in self.graphs and key not in self.eager:
            reason = self._capture(key, sampling)
            if reason is not None:
                self.eager[key] = reason
                log.warning("draft chains of %d rows run eagerly (slow): %s", b, reason)
        if key in self.graphs:
            self.graphs[key].replay()
            self.replays += 1
            return self.outputs[key]
        if b > len(self.host):  # a refused capture: the real rows alone, eagerly
            b = len(self.host)
        return self._step(b, n, mode, sampling, graph=False, catch=catch)

    def _capture(self, key: tuple, sampling) -> str | None:
        b, n, mode, catch = key
        return capture_step(self, key, lambda: self._step(b, n, mode, sampling, graph=True, catch=catch),
                            sampling, f"the draft chain of {b} rows, {n} forwards"
                            + (f" after a {catch}-token catch-up" if catch else "") + f" ({mode})")


class FollowGraphs:
    """The MTP layer's follow-up of a verify step (lowbit.engine.speculative.MTPDrafter.follow)
    over static buffers, one CUDA graph per (rows bucket, width W).

    In decode state a request's follow-up is m <= k + 1 positions c .. c + m - 1 (the last real
    token and the accepted drafts): the target's hidden states there and the tokens after them.
    Each row feeds W >= m tokens, front-padded as the draft catch-up is (DraftChainGraphs): at
    positions end - W .. end - 1 (end = c + m, the sequence length), a padding token attends
    to real entries and writes its KV to the scratch block; the layer's output at each row's
    last token, always real, gives the request's next draft. Static inputs, filled by `stage`
    outside the graph: hid [R W, D] (the target's hidden rows, gathered), ids [R W], end [R],
    count [R], tables [R, width]. Outputs: the layer's output [R, D] and logits [R, V] at
    each row's last token.
    """

    def __init__(self, model: torch.nn.Module, kv_cache, max_rows: int, max_blocks: int,
                 device: torch.device, capture: bool) -> None:
        self.model, self.kv_cache, self.device, self.capture_on = model, kv_cache, device, capture
        self.buckets = graph_buckets(max_rows)
        r, w = self.buckets[-1], PAD_WIDTHS[-1]
        self.ids = torch.zeros(r * w, dtype=torch.long, device=device)
        self.end = torch.zeros(r, dtype=torch.long, device=device)
        self.count = torch.zeros(r, dtype=torch.long, device=device)
        self.tables = torch.full((r, max_blocks), kv_cache.scratch_block, dtype=torch.int32, device=device)
        self.starts = {w: torch.arange(r + 1, dtype=torch.int32, device=device) * w for w in PAD_WIDTHS}
        self.hid = None  # [r * w, D], made at the first stage (the hidden states' dtype and width)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.eager: dict[tuple, str] = {}
        self.pool = None
        self.replays = 0

    def stage(self, hidden: torch.Tensor, rows: list[list[int]], ids: list[list[int]],
              entries: list[tuple[list[int], int, int]], width: int) -> int:
        """Fill the static inputs for len(entries) rows: entry (table, c, m), rows[i] its m
        hidden rows, ids[i] its m next tokens; returns the rows the step runs (a bucket when
        capturing: padded rows at positions 0 .. W - 1 over the scratch block)."""
        n = len(entries)
        b = next(x for x in self.buckets if x >= n) if self.capture_on else n
        if any(len(t) > self.tables.shape[1] for t, _, _ in entries):
            raise AssertionError("a block table is wider than the follow-up's buffers")
        if self.hid is None:
            self.hid = torch.zeros(self.ids.shape[0], hidden.shape[-1], dtype=hidden.dtype, device=self.device)
        index = torch.zeros(b, width, dtype=torch.long)
        tok = torch.zeros(b, width, dtype=torch.long)
        tables = torch.full((b, self.tables.shape[1]), self.kv_cache.scratch_block, dtype=torch.int32)
        for i, ((table, _, m), rr, tt) in enumerate(zip(entries, rows, ids)):
            index[i] = torch.as_tensor(rr[:1] * (width - m) + rr)
            tok[i, width - m:] = torch.as_tensor(tt)
            tables[i, :len(table)] = torch.as_tensor(table, dtype=torch.int32)
        self.hid[:b * width].copy_(hidden[index.view(-1).to(hidden.device, non_blocking=True)])
        self.ids[:b * width].copy_(tok.view(-1), non_blocking=True)
        self.tables[:b].copy_(tables, non_blocking=True)
        self.end[:b].copy_(torch.as_tensor([c + m for _, c, m in entries] + [width] * (b - n)), non_blocking=True)
        self.count[:b].copy_(torch.as_tensor([m for _, _, m in entries] + [width] * (b - n)), non_blocking=True)
        return b

    def batch(self, b: int, width: int) -> ForwardBatch:
        """The follow-up's metadata on the device (what a graph replays), as catch_up_batch's."""
        return front_padded_batch(self.end[:b], self.count[:b], self.tables[:b], width,
                                  self.starts[width][:b + 1], self.kv_cache)

    def _step(self, b: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = b * width
        emb = self.model.model.embed_tokens(self.ids[:n])
        out = self.model.mtp.predict(self.hid[:n], emb, self.batch(b, width))[width - 1::width]
        return out, self.model.compute_logits(out)

    def run(self, b: int, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The staged follow-up's (output [b, D], logits [b, V]) from a graph replay, or None
        where there is no graph (not capturing, or the capture was refused: the caller runs
        the follow-up eagerly)."""
        key = (b, width)
        if not self.capture_on or key in self.eager:
            return None
        if key not in self.graphs:
            reason = capture_step(self, key, lambda: self._step(b, width), None,
                                  f"the MTP follow-up of {b} rows of {width} tokens")
            if reason is not None:
                self.eager[key] = reason
                log.warning("MTP follow-ups of %d rows run eagerly (slow): %s", b, reason)
                return None
        self.graphs[key].replay()
        self.replays += 1
        return self.outputs[key]
