"""StepInputs: a step's flat metadata, built on the host and sent to the device in one go.

Shapes: T tokens of the step (<= max_tokens), B sequences (<= max_seqs), W block-table
width (<= max_blocks).
Host side, every field lives in a pinned buffer that `stage()` fills from Python lists
(through numpy views: one slice assignment a field); the sequence fields and the pending
pairs are views of one small buffer, and so are the token fields of a step of up to
COMPACT_TOKENS tokens (a second copy of each field's first rows, at the buffer's end; a
longer step uses full-length fields of their own). `upload()` issues non-blocking copies
into persistent device buffers laid out the same way (one for the small buffer, one a token
field for a long step, the drafts' pairs when there are some, the tables: two for a decode
or verify step), the same buffers a captured graph reads, so a replay needs no further copy.
A graph of up to COMPACT_TOKENS tokens reads the compact fields, a longer one the others,
as the step it replays was staged. The upload
records an event; the next `stage()` waits on it before it overwrites the pinned memory,
so a copy still in flight never reads the next step's values.

Pending tokens (async scheduling): a token the step before sampled, still unread by the
host, is staged as a placeholder; `fill_pending` then overwrites it on the device from that
step's sampled tokens (K pairs: flat index in input_ids, index in the sampled tokens), after
the upload and before the forward or graph replay, with no host sync.

Drafted tokens (speculative decoding with a model drafter) are staged the same way: D pairs
(flat index in input_ids, index in the drafter's flat device tensor), and `fill_drafts`
copies them in on the device.

Sequence fields beside the per-sequence metadata: query_start [B + 1] (int32, the flat
index of each sequence's first new token), last_index [B] (its last new token: the row the
logits are taken from) and sample_rows [B] (its sampler row when it samples this step, else
the scratch row), which a captured prefill step reads; picks [<= B] (the sequences that
sample, in order: where their tokens sit in a prefill graph's output).

Rows past the step's B (graph padding) are filled so that a padded row is harmless: token
0 at position 0, writing the pool's scratch row, reading one token of the scratch block,
and sampling into the sampler's scratch row. A decode bucket pads tokens and sequences
alike (padded sequence i owns padded token i). A prefill bucket pads them apart
(`pad_tokens`): the padded tokens form one padded sequence B, a fresh prompt of
pad_tokens - T tokens over the scratch block, so every row of the padded step is computed
from finite inputs (the pool zeroes its scratch block when it allocates: a padded prompt
attends over rows no real token writes, and stale NaN bytes there would make a NaN router
row); the sequences after it are empty.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

COMPACT_TOKENS = 256  # steps of up to this many tokens send their token fields in the small buffer


@dataclass
class Padding:
    scratch_row: int  # KV pool row padded tokens write
    scratch_block: int  # block padded table entries name
    sampler_row: int  # sampling-state row padded sequences use


class StepInputs:
    TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping")
    SEQ_FIELDS = ("seq_lens", "rows", "steps", "query_start", "last_index", "sample_rows", "picks")
    FIELDS = TOKEN_FIELDS + SEQ_FIELDS
    PENDING = ("pending_at", "pending_src")
    DRAFTS = ("draft_at", "draft_src")

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, padding: Padding,
                 device: torch.device) -> None:
        self.device, self.pad = device, padding
        pin = device.type == "cuda"
        dtypes = {"seq_lens": torch.int32, "query_start": torch.int32}
        self.host = {f: torch.zeros(max_tokens, dtype=torch.long, pin_memory=pin) for f in self.TOKEN_FIELDS}
        self.dev = {f: torch.zeros(max_tokens, dtype=torch.long, device=device) for f in self.TOKEN_FIELDS}
        # the sequence fields and the pending pairs share one buffer on each side (typed views
        # at fixed offsets, 8-byte aligned): `upload` sends them in one copy, the whole buffer
        # (a few KiB), where one copy a field cost a host-to-device call each
        # a step of up to `compact` tokens (decode buckets, verify steps) keeps its token
        # fields in that buffer too ("@" copies of the fields, at its end): its upload is the
        # one copy and the tables' (on the H200 host the five copies of a verify step took
        # 121 us); longer steps use the full-length fields
        self.compact = min(max_tokens, COMPACT_TOKENS)
        small = {**{f: max_seqs for f in self.SEQ_FIELDS}, "query_start": max_seqs + 1,
                 **{f: max_seqs for f in self.PENDING},  # pending pairs: [K <= B]
                 **{f + "@": self.compact for f in self.TOKEN_FIELDS}}
        offsets, nbytes = {}, 0
        for f, n in small.items():
            offsets[f] = nbytes
            nbytes += -(-n * dtypes.get(f, torch.long).itemsize // 8) * 8
        self._small_host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        self._small_dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._compact_host, self._compact_dev = {}, {}
        for f, n in small.items():
            dt = dtypes.get(f, torch.long)
            span = slice(offsets[f], offsets[f] + n * dt.itemsize)
            host, dev = (self._compact_host, self._compact_dev) if f.endswith("@") else (self.host, self.dev)
            host[f.rstrip("@")] = self._small_host[span].view(dt)
            dev[f.rstrip("@")] = self._small_dev[span].view(dt)
        self.host_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, pin_memory=pin)
        self.block_tables = torch.full((max_seqs, max_blocks), padding.scratch_block,
                                       dtype=torch.int32, device=device)
        for f in self.DRAFTS:  # [D <= T]
            self.host[f] = torch.zeros(max_tokens, dtype=torch.long, pin_memory=pin)
            self.dev[f] = torch.zeros(max_tokens, dtype=torch.long, device=device)
        # numpy views of the pinned buffers: a slice assignment from a Python list is one call
        # (a torch.as_tensor and a copy per field cost several times more host time a step)
        self.host_np = {f: t.numpy() for f, t in self.host.items()}
        self._compact_np = {f: t.numpy() for f, t in self._compact_host.items()}
        self.tables_np = self.host_tables.numpy()
        self._uploaded = torch.cuda.Event() if pin else None
        self._views: dict[tuple, dict[str, torch.Tensor]] = {}  # tokens() / seqs() per n
        self.num_tokens = self.num_seqs = self.width = self.num_pending = self.num_drafts = 0

    def stage(self, values: dict[str, list[int]], tables: list[list[int]], pad_to: int = 0,
              pending: list[tuple[int, int]] = (), pad_tokens: int | None = None,
              drafts: list[tuple[int, int]] = ()) -> None:
        """Fill the pinned buffers: token fields [T], sequence fields [B] (query_start
        [B + 1]), tables [B][<=W], pending (flat index, sampled index) pairs [K], drafts
        (flat index, index in the drafter's tokens) pairs [D]. With pad_to
        (a graph bucket) token and sequence fields are padded to pad_to rows; with
        pad_tokens too (a prefill bucket) tokens are padded to pad_tokens rows instead, the
        padded tokens forming sequence B (pad_to > B then)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last upload has left the pinned buffers
        self.num_pending, self.num_drafts = len(pending), len(drafts)
        for fields, pairs in ((self.PENDING, pending), (self.DRAFTS, drafts)):
            for f, vals in zip(fields, zip(*pairs)):
                self.host_np[f][:len(pairs)] = vals
        t, b = len(values["input_ids"]), len(tables)
        n_tok, n_seq = max(t, pad_to if pad_tokens is None else pad_tokens), max(b, pad_to)
        fill = {"input_ids": 0, "positions": 0, "slot_mapping": self.pad.scratch_row,
                "seq_lens": 1, "rows": self.pad.sampler_row, "steps": 0, "last_index": 0,
                "sample_rows": self.pad.sampler_row, "query_start": n_tok, "picks": 0}
        token_np = self._compact_np if n_tok <= self.compact else self.host_np
        for f in self.FIELDS:
            n = n_tok if f in self.TOKEN_FIELDS else n_seq + (f == "query_start")
            vals, buf = values[f], (token_np if f in self.TOKEN_FIELDS else self.host_np)[f]
            buf[:len(vals)] = vals
            buf[len(vals):n] = fill[f]
        if pad_tokens is None and n_seq > b:  # decode padding: padded sequence i owns token i
            self.host_np["query_start"][b + 1:n_seq + 1] = range(t + 1, t + 1 + n_seq - b)
        elif n_tok > t:  # prefill padding: the padded tokens are sequence b's prompt
            assert n_seq > b, "a padded prefill step needs a padded sequence"
            self.host_np["seq_lens"][b] = n_tok - t
        width = max((len(row) for row in tables), default=1)  # none: a padding-only step
        self.tables_np[:n_seq, :width] = self.pad.scratch_block
        for i, row in enumerate(tables):
            self.tables_np[i, :len(row)] = row
        self.num_tokens, self.num_seqs, self.width = n_tok, n_seq, width

    def upload(self) -> None:
        """Non-blocking copies of the staged rows into the device buffers: the sequence fields
        and pending pairs in one copy, each token field's rows, the drafts' pairs, the tables."""
        nb = self.device.type == "cuda"
        self._small_dev.copy_(self._small_host, non_blocking=nb)  # a compact step's tokens too
        if self.num_tokens > self.compact:  # a long step: a copy a token field
            for f in self.TOKEN_FIELDS:
                self.dev[f][:self.num_tokens].copy_(self.host[f][:self.num_tokens], non_blocking=nb)
        for f in self.DRAFTS:
            if self.num_drafts:
                self.dev[f][:self.num_drafts].copy_(self.host[f][:self.num_drafts], non_blocking=nb)
        b, w = self.num_seqs, self.width
        self.block_tables[:b, :w].copy_(self.host_tables[:b, :w], non_blocking=nb)
        if self._uploaded is not None:
            self._uploaded.record()

    def fill_pending(self, sampled: torch.Tensor) -> None:
        """input_ids[pending_at[k]] = sampled[pending_src[k]], on the device; sampled [B'] is
        the step before's tokens."""
        self._fill(self.PENDING, self.num_pending, sampled)

    def fill_drafts(self, drafted: torch.Tensor) -> None:
        """input_ids[draft_at[d]] = drafted[draft_src[d]], on the device: a model drafter's
        tokens [N] go into the verify step's input without a trip through the host."""
        self._fill(self.DRAFTS, self.num_drafts, drafted)

    def _fill(self, fields: tuple[str, str], n: int, source: torch.Tensor) -> None:
        """input_ids[at[i]] = source[src[i]] for the n staged (at, src) pairs of `fields`."""
        if n:
            at, src = (self.dev[f][:n] for f in fields)
            self.tokens()["input_ids"].index_copy_(0, at, source.index_select(0, src))

    def tokens(self, n: int | None = None) -> dict[str, torch.Tensor]:
        """Device views of the token fields, n rows (default: the staged count). The views
        are kept per n (the buffers never move): a step pays no slicing (a few us of host
        time a view on CUDA). Read-only: do not add keys."""
        n = self.num_tokens if n is None else n
        compact = self.num_tokens <= self.compact  # where the staged step's tokens went
        assert not compact or n <= self.compact, f"{n} token rows of a step staged with {self.num_tokens}"
        views = self._views.get(("tokens", n, compact))
        if views is None:
            dev = self._compact_dev if compact else self.dev
            views = self._views[("tokens", n, compact)] = {f: dev[f][:n] for f in self.TOKEN_FIELDS}
        return views

    def seqs(self, n: int | None = None) -> dict[str, torch.Tensor]:
        """Device views of the sequence fields, n rows (query_start n + 1), kept per n like
        `tokens`."""
        n = self.num_seqs if n is None else n
        views = self._views.get(("seqs", n))
        if views is None:
            views = self._views[("seqs", n)] = {f: self.dev[f][:n + (f == "query_start")] for f in self.SEQ_FIELDS}
        return views


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list as a device tensor without a stream sync. A blocking copy to CUDA
    waits for every kernel queued before it; a non-blocking one from pageable memory stages
    the bytes and returns at once (the list's temporary may then be freed)."""
    return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)


class _ReadBuffers(threading.local):
    """Per thread: a pinned buffer per dtype (grown as needed) and one event, reused by
    `read_list` (a fresh pinned tensor and event a read cost host time every step)."""

    def __init__(self) -> None:
        self.pinned: dict[torch.dtype, torch.Tensor] = {}
        self.event: torch.cuda.Event | None = None


_READ = _ReadBuffers()


def read_list(t: torch.Tensor) -> list:
    """t's values as a (nested) list. On CUDA a non-blocking copy into a reused pinned buffer
    and a wait on an event recorded after it, never a device or stream synchronize (so a
    step under torch.cuda.set_sync_debug_mode("error") can read its tokens). The buffer is
    reused by the next read: only the list leaves this function."""
    if not t.is_cuda:
        return t.tolist()
    buf = _READ.pinned.get(t.dtype)
    if buf is None or buf.numel() < t.numel():
        buf = _READ.pinned[t.dtype] = torch.empty(max(t.numel(), 4096), dtype=t.dtype, pin_memory=True)
    if _READ.event is None:
        _READ.event = torch.cuda.Event()
    host = buf[:t.numel()].view(t.shape)
    host.copy_(t, non_blocking=True)
    _READ.event.record()
    _READ.event.synchronize()
    return host.tolist()
