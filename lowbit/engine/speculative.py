"""Speculative decoding: draft tokens, verified by the target in the same step as everything else.

A step with speculation, in the engine's three stages:
1. `plan` (before scheduling): each running request in decode state gets up to k draft slots
   (`Request.draft_token_ids`; n-gram drafts are the tokens themselves, model drafts are
   placeholders until step 3), capped by its max_tokens and the context. The scheduler
   treats them as known, uncomputed tokens: a request's window becomes 1 + k tokens, and
   requests with and without drafts (prefill chunks, plain decodes) share the step.
2. `propose` (the runner, after scheduling): drafts cut to the scheduled window; a draft
   model catches its own KV cache up with the target's tokens and chains k forwards; the MTP
   head chains from what the last step left (`follow`). A chain feeds each draft to the next
   forward on the device, and the drafts stay there: the runner copies them into the verify
   input (StepInputs.fill_drafts) and the acceptance gathers them. A draft model's chain
   where every drafting request wants the same k > 1 runs over static buffers, one CUDA
   graph replay per step on CUDA (lowbit.engine.draft_graphs).
3. `verify` (the runner, after the target's forward): the target's logits at the last real
   token and at every draft go through the lossless rule (lowbit.engine.acceptance); the
   host reads the accepted tokens once. Where every row is greedy, no row has a penalty and
   the drafts are point masses, the rule needs only the target's argmax at each position:
   the device computes that, the host reads it (and a model drafter's device drafts) and
   compares, which saves the rule's twenty-odd device ops a step
   (`_accept_on_host`). Where the verify replayed a HIDDEN prefill graph of at most
   VERIFY_ARGMAX_TOKENS tokens, that graph already wrote every row's logits and argmax: a
   greedy step reads the argmax whole and picks the verify rows itself, so nothing is
   launched after the replay (no row gather, no lm_head, no upload) unless a pick wants
   log-probabilities; any other step gathers its rows of the graph's logits. The engine
   appends them, and rejected drafts' KV
   slots are rolled back (num_computed_tokens stops before them, BlockManager.trim gives
   back their blocks; they were never full of computed tokens, so never in the prefix
   cache). `follow` then runs the MTP layer over the positions this step made real.

With --speculative-adaptive, `plan` takes each step's k (at most the configured k) from
lowbit.engine.draft_length, which `propose`, `verify` and `observe` (the engine, once the
step's tokens are read) feed with the step's wall-clock, drafting time and acceptance.

Synthetic acceptance (`lowbit bench latency --spec-synthetic-accept P`, never on otherwise):
`plan` pads every request's drafts to k with its last token, so each verify step carries
k + 1 tokens even where prompt lookup finds nothing (random weights), and `verify` draws
the verdicts from a seeded generator (on the host in greedy steps, else on the device):
draft j is kept with probability P given drafts 0..j-1 were. The step does all its real work; the text is not the model's.

Draft KV: a draft model has a pool of its own with the target's block tables (same block
ids), and tracks per request how many positions it holds. The MTP layer is cache layer
num_layers of the target's pool. Neither can change what is emitted: drafts are proposals.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from lowbit.engine.acceptance import accept, draft_tokens
from lowbit.engine.batch import ForwardBatch
from lowbit.engine.cuda_graphs import graphs_wanted
from lowbit.engine.draft_graphs import DraftChainGraphs, FollowGraphs, flat_batch, pad_width
from lowbit.engine.draft_length import DraftLength
from lowbit.engine.metrics import HostSpans
from lowbit.engine.paged_cache import PagedKVCache
from lowbit.engine.prefill_graphs import prefill_graphs_wanted
from lowbit.engine.request import Request
from lowbit.engine.staging import read_list, to_device
from lowbit.errors import LowbitError

log = logging.getLogger("lowbit")

NGRAM_MAX, NGRAM_MIN = 3, 1  # suffix lengths prompt lookup tries, longest first
SYNTHETIC_SEED = 0  # the forced acceptance's generator (bench only)


@dataclass
class SpecStats:
    """Acceptance counters: verify steps of a sequence with drafts, drafts proposed and
    accepted, and accepted drafts per position (position j: the j-th draft of a step)."""

    num_steps: int = 0
    num_drafts: int = 0
    num_accepted: int = 0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        grow = num_drafts - len(self.proposed_at)
        if grow > 0:
            self.proposed_at += [0] * grow
            self.accepted_at += [0] * grow
        self.num_steps += 1
        self.num_drafts += num_drafts
        self.num_accepted += num_accepted
        for j in range(num_drafts):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < num_accepted

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step of a sequence: accepted drafts + 1."""
        return 1 + self.num_accepted / max(self.num_steps, 1)

    @property
    def accept_rate_per_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    def as_dict(self) -> dict:
        return {"verify_steps": self.num_steps, "drafts": self.num_drafts, "accepted": self.num_accepted,
                "mean_accepted_length": self.mean_accepted_length,
                "accept_rate": self.num_accepted / max(self.num_drafts, 1),
                "accept_rate_per_position": self.accept_rate_per_position}


def ngram_lookup(ids: list[int], k: int) -> list[int]:
    """Prompt lookup: the k tokens after the latest earlier occurrence of the longest suffix
    of `ids` (NGRAM_MAX down to NGRAM_MIN tokens) that occurred before; [] when none did."""
    for n in range(min(NGRAM_MAX, len(ids) - 1), NGRAM_MIN - 1, -1):
        suffix, last = ids[-n:], ids[-1]
        for i in range(len(ids) - n - 1, -1, -1):
            if ids[i + n - 1] == last and ids[i:i + n] == suffix:
                return ids[i + n:i + n + k]
    return []


class NgramIndex:
    """`ngram_lookup` over one request's append-only tokens at a constant cost a step: for
    each suffix length n, the latest start of every n-gram that ends before the last token,
    keyed by the n-gram packed into one int (21 bits a token). A step indexes the positions
    added since the last call and looks its suffixes up, where `ngram_lookup` scans the
    context (milliseconds a step at 32k tokens when the suffix is rare, all of it serial
    with the device). A long stretch (the prompt) is keyed with numpy. Same answers as the
    scan (tests/engine/test_speculative.py); a list that is not the indexed one grown
    (shorter, or its last indexed token changed) is indexed anew, and ids past 21 bits (no
    vocabulary has them) fall back to the scan."""

    BITS = 21
    VECTOR_FROM = 64  # new positions from which numpy keys them

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.starts: dict[int, dict[int, int]] = {n: {} for n in range(NGRAM_MIN, NGRAM_MAX + 1)}
        self.done = 0  # n-grams ending before position `done` are indexed
        self.seen: int | None = None  # the token at done - 1 when indexed
        self.scan = False  # an id too wide for the packed keys: ngram_lookup instead

    def lookup(self, ids: list[int], k: int) -> list[int]:
        n_ids = len(ids)
        if n_ids < self.done or (self.done and ids[self.done - 1] != self.seen):
            self.reset()
        if n_ids - 1 > self.done and not self.scan:
            self._index(ids, self.done, n_ids - 1)
            self.done, self.seen = n_ids - 1, ids[n_ids - 2]
        if self.scan or (ids and not 0 <= ids[-1] < 1 << self.BITS):
            self.scan = True
            return ngram_lookup(ids, k)
        keys, key = {}, 0
        for n in range(1, min(NGRAM_MAX, n_ids - 1) + 1):  # the suffix's keys, shortest first
            key |= ids[n_ids - n] << (self.BITS * (n - 1))
            keys[n] = key
        for n in range(min(NGRAM_MAX, n_ids - 1), NGRAM_MIN - 1, -1):
            i = self.starts[n].get(keys[n])
            if i is not None:
                return ids[i + n:i + n + k]
        return []

    def _index(self, ids: list[int], lo: int, hi: int) -> None:
        """Index the n-grams ending at positions lo .. hi - 1."""
        first = max(0, lo - NGRAM_MAX + 1)
        if hi - lo < self.VECTOR_FROM:
            window = ids[first:hi]
            if any(not 0 <= t < 1 << self.BITS for t in window):
                self.scan = True
                return
            for end in range(lo, hi):  # each n's key extends the shorter one's: one shift an n
                key = 0
                for n in range(1, min(NGRAM_MAX, end + 1) + 1):
                    key |= ids[end + 1 - n] << (self.BITS * (n - 1))
                    if n >= NGRAM_MIN:
                        self.starts[n][key] = end + 1 - n
            return
        a = np.asarray(ids[first:hi], dtype=np.int64)
        if a.size and (a.min() < 0 or a.max() >= 1 << self.BITS):
            self.scan = True
            return
        for n, starts in self.starts.items():
            e0 = max(lo, n - 1)  # the first end with a whole n-gram
            if e0 >= hi:
                continue
            r0 = e0 - n + 1 - first  # the first n-gram's start in `a`
            count = hi - e0
            keys = a[r0:r0 + count].copy()
            for j in range(1, n):
                keys = (keys << self.BITS) | a[r0 + j:r0 + j + count]
            starts.update(zip(keys.tolist(), range(e0 - n + 1, e0 - n + 1 + count)))


@dataclass
class Drafting:
    """What `propose` hands a model drafter: scheduled requests, and per request the real
    tokens in its window and the drafts wanted (0 for prefill chunks)."""

    reqs: list[Request]
    num_real: list[int]
    num_drafts: list[int]
    row_ids: list[int]  # [B] sampler rows
    device: torch.device
    sampling: object  # SamplingState
    mode: object  # SampleMode of the drafting requests
    flat: torch.Tensor | None = None  # [N + 1] the drafted tokens on the device, then a 0 (`write`)
    where: dict[str, list[int]] = field(default_factory=dict)  # request id -> its drafts' indices in flat

    @cached_property
    def rows(self) -> torch.Tensor:
        """The sampler rows [B] on the device, uploaded when a drafter first samples (an
        n-gram step never does: it pays no upload)."""
        return to_device(self.row_ids, self.device)

    def sample(self, logits: torch.Tensor, picks: list[int], j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft j of the requests `picks` from logits [len(picks), V]: tokens [len(picks)]
        on the device (the chain feeds them on without a host read), q or None."""
        sel = to_device(picks, logits.device)
        steps = to_device([self.reqs[i].num_tokens + j for i in picks], logits.device)
        return draft_tokens(logits, self.sampling, self.rows[sel], steps, self.mode)

    def write(self, drafted: list[tuple[list[int], torch.Tensor]]) -> None:
        """Each chain step's (picks, tokens) as the drafts of the requests, kept on the
        device: `flat` [N] and, per request id, where its drafts 0, 1, ... sit in it. The
        host's draft slots keep their placeholders; the runner copies the tokens into the
        verify step's input on the device (StepInputs.fill_drafts), and the host learns the
        accepted ones from the verify step's one read."""
        if not drafted:
            return
        self.flat = torch.cat([t for _, t in drafted] + [drafted[0][1].new_zeros(1)])  # last: a pad 0
        at = 0
        for picks, _ in drafted:
            for i in picks:
                self.where.setdefault(self.reqs[i].request_id, []).append(at)
                at += 1


class NgramDrafter:
    needs_hidden = False

    def __init__(self) -> None:
        self.index: dict[str, NgramIndex] = {}  # request id -> its prompt-lookup index

    def available(self, req: Request) -> bool:
        return True

    def plan(self, req: Request, k: int) -> list[int]:
        index = self.index.get(req.request_id)
        if index is None:
            index = self.index[req.request_id] = NgramIndex()
        return index.lookup(req.token_ids, k)

    def propose(self, work: Drafting) -> dict[int, torch.Tensor]:
        return {}

    def release(self, request_id: str) -> None:
        self.index.pop(request_id, None)


class ModelDrafter:
    """A smaller model with the target's tokenizer, in a KV pool of its own."""

    needs_hidden = False

    def __init__(self, model: torch.nn.Module, target_cache: PagedKVCache, device: torch.device,
                 max_num_seqs: int = 0, max_model_len: int = 0, graphs: bool = False) -> None:
        self.model, self.device = model, device
        dtype = next(model.parameters()).dtype
        self.kv_cache = PagedKVCache(model.num_cache_layers, target_cache.num_blocks, target_cache.block_size,
                                     dtype, device)
        self.done: dict[str, int] = {}  # request id -> positions this pool holds
        # chains where every drafting request wants the same k > 1 run over static buffers,
        # captured as CUDA graphs with `graphs` (lowbit.engine.draft_graphs); others chain eagerly
        self.chain = None
        if max_num_seqs and max_model_len:
            self.chain = DraftChainGraphs(model, self.kv_cache, max_num_seqs,
                                          -(-max_model_len // target_cache.block_size), device, graphs)
        # captured, the catch-up reads no host length only through a graph-safe prefill route
        self.fused_refusal = prefill_graphs_wanted(model) if graphs else None
        if self.fused_refusal is not None and device.type == "cuda":
            log.warning("draft catch-ups run eagerly before each chain (slow): %s", self.fused_refusal)

    def available(self, req: Request) -> bool:
        return True

    def plan(self, req: Request, k: int) -> list[int]:
        return [0] * k

    def release(self, request_id: str) -> None:
        self.done.pop(request_id, None)

    def propose(self, work: Drafting) -> dict[int, torch.Tensor]:
        """Catch up with every scheduled request's real tokens, then chain the drafts;
        returns the draft distributions of sampled drafts ({index: [k, V]})."""
        entries, ids, last = [], [], {}
        for i, req in enumerate(work.reqs):
            start = self.done.setdefault(req.request_id, req.num_computed_tokens)
            end = req.num_computed_tokens + work.num_real[i]
            if end > start:
                entries.append((req.block_table, start, end - start))
                ids += req.token_ids[start:end]
                last[i] = len(ids) - 1
            self.done[req.request_id] = max(start, end)
        if not entries:
            return {}
        k, width = self._fused_k(work, entries, last)
        if k:
            return self._fused_chain(work, entries, ids, k, width)
        hidden = self.model(to_device(ids, self.device), flat_batch(entries, self.kv_cache, self.device))
        picks = [i for i in last if work.num_drafts[i]]
        if not picks:
            return {}
        return self._chain(work, picks, self.model.compute_logits(hidden[[last[i] for i in picks]]))

    def _fused_k(self, work: Drafting, entries: list, last: dict[int, int]) -> tuple[int, int]:
        """(k, W) when the catch-up can join the static chain (lowbit.engine.draft_graphs): every
        request with a catch-up drafts, all want the same k, each catch-up is at most W (2, 4
        or 8) tokens ending at its draft-0 position past the first W positions, and (capturing)
        the prefill attention route is graph-safe; else (0, 0)."""
        if self.chain is None or self.fused_refusal is not None:
            return 0, 0
        wanted = {work.num_drafts[i] for i in last}
        k = min(wanted)
        if len(wanted) != 1 or k < 1 or any(work.num_drafts[i] for i in range(len(work.reqs)) if i not in last):
            return 0, 0
        width = pad_width(max(n for _, _, n in entries))
        for i, (_, start, n) in zip(last, entries):
            if width is None or start + n != work.reqs[i].num_tokens or start + n < width:
                return 0, 0
        return k, width

    def _fused_chain(self, work: Drafting, entries: list, ids: list[int], k: int,
                     width: int) -> dict[int, torch.Tensor]:
        """Catch-up, draft 0 and drafts 1..k-1 as one static step (one replay on CUDA)."""
        rows, at = [], 0
        for _, _, n in entries:
            rows.append(ids[at:at + n])
            at += n
        picks = [i for i in range(len(work.reqs)) if work.num_drafts[i]]  # = the rows with a catch-up
        reqs = [work.reqs[i] for i in picks]
        sel = to_device(picks, work.rows.device)
        b = self.chain.stage(None, [r.num_tokens for r in reqs], [r.block_table for r in reqs], work.rows[sel],
                             work.sampling)
        self.chain.stage_catch_up(b, entries, rows, width)
        toks, qs = self.chain.run(b, k - 1, work.mode, work.sampling, catch=width)
        n = len(picks)
        work.write([(picks, toks[j, :n]) for j in range(k)])
        if qs is None:
            return {}
        return {i: qs[:, r] for r, i in enumerate(picks)}

    def _chain(self, work: Drafting, picks: list[int], logits: torch.Tensor | None) -> dict[int, torch.Tensor]:
        wanted = {work.num_drafts[i] for i in picks}
        if self.chain is not None and len(wanted) == 1 and min(wanted) > 1:
            return self._static_chain(work, picks, logits, min(wanted))
        qs: dict[int, list[torch.Tensor]] = {}
        drafted = []
        for j in range(max((work.num_drafts[i] for i in picks), default=0)):
            picks = [i for i in picks if work.num_drafts[i] > j]
            tokens, q = work.sample(logits, picks, j)
            drafted.append((picks, tokens))
            if q is not None:
                for r, i in enumerate(picks):
                    qs.setdefault(i, []).append(q[r])
            keep = [r for r, i in enumerate(picks) if work.num_drafts[i] > j + 1]
            if not keep:
                break
            nxt = [picks[r] for r in keep]
            entries = [(work.reqs[i].block_table, work.reqs[i].num_tokens + j, 1) for i in nxt]
            ids = tokens[to_device(keep, tokens.device)] if len(keep) < len(picks) else tokens
            hidden = self.model(ids, flat_batch(entries, self.kv_cache, self.device))
            logits, picks = self.model.compute_logits(hidden), nxt
        work.write(drafted)
        return {i: torch.stack(q) for i, q in qs.items()}

    def _static_chain(self, work: Drafting, picks: list[int], logits: torch.Tensor, k: int) -> dict[int, torch.Tensor]:
        """Draft 0 from the catch-up logits, drafts 1..k-1 from the static chain (one replay on CUDA)."""
        tokens, q = work.sample(logits, picks, 0)
        reqs = [work.reqs[i] for i in picks]
        sel = to_device(picks, work.rows.device)
        b = self.chain.stage(tokens, [r.num_tokens for r in reqs], [r.block_table for r in reqs], work.rows[sel],
                             work.sampling)
        toks, qs = self.chain.run(b, k - 1, work.mode, work.sampling)
        n = len(picks)
        work.write([(picks, tokens)] + [(picks, toks[j, :n]) for j in range(k - 1)])
        if q is None:
            return {}
        return {i: torch.cat([q[r:r + 1], qs[:, r]]) for r, i in enumerate(picks)}


class MTPDrafter:
    """DeepSeek-V3's MTP layer, chained for k > 1: draft 1 comes from the layer's output at
    the last real position (`follow`, after the verify step that made it real), draft j + 1
    from the layer run again on its own output hidden state and the embedding of draft j."""

    needs_hidden = True

    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, device: torch.device,
                 max_num_seqs: int = 0, max_model_len: int = 0, graphs: bool = False) -> None:
        if getattr(model, "mtp", None) is None:
            raise LowbitError("--speculative-method mtp needs a checkpoint with an MTP layer "
                              "(num_nextn_predict_layers: 1); use ngram or draft for this model")
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.last: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (hidden [D], logits [V])
        # decode-state follow-ups over static buffers, replayed as CUDA graphs with `graphs`
        # (lowbit.engine.draft_graphs.FollowGraphs); else eagerly
        self.graphs = None
        if max_num_seqs and max_model_len:
            if graphs and (why := prefill_graphs_wanted(model)) is not None:
                graphs = False
                log.warning("MTP follow-ups run eagerly (slow): %s", why)
            self.graphs = FollowGraphs(model, kv_cache, max_num_seqs, -(-max_model_len // kv_cache.block_size),
                                       device, graphs)

    def available(self, req: Request) -> bool:
        return req.request_id in self.last

    def plan(self, req: Request, k: int) -> list[int]:
        return [0] * k

    def release(self, request_id: str) -> None:
        self.last.pop(request_id, None)

    def _predict(self, hidden: torch.Tensor, next_ids: list[int] | torch.Tensor, entries) -> torch.Tensor:
        """The MTP layer's output [T, D] at the entries' positions (mtp_forward before its head)."""
        batch = flat_batch(entries, self.kv_cache, self.device)
        emb = self.model.model.embed_tokens(to_device(next_ids, self.device))  # [T, D]
        return self.model.mtp.predict(hidden, emb, batch)

    def propose(self, work: Drafting) -> dict[int, torch.Tensor]:
        picks = [i for i, k in enumerate(work.num_drafts) if k]
        if not picks:
            return {}
        hidden = torch.stack([self.last[work.reqs[i].request_id][0] for i in picks])
        logits = torch.stack([self.last[work.reqs[i].request_id][1] for i in picks])
        qs: dict[int, list[torch.Tensor]] = {}
        drafted = []
        for j in range(max(work.num_drafts[i] for i in picks)):
            tokens, q = work.sample(logits, picks, j)
            drafted.append((picks, tokens))
            if q is not None:
                for r, i in enumerate(picks):
                    qs.setdefault(i, []).append(q[r])
            keep = [r for r, i in enumerate(picks) if work.num_drafts[i] > j + 1]
            if not keep:
                break
            picks = [picks[r] for r in keep]
            entries = [(work.reqs[i].block_table, work.reqs[i].num_tokens - 1 + j, 1) for i in picks]
            rows = to_device(keep, tokens.device)
            hidden = self._predict(hidden[rows], tokens[rows], entries)
            logits = self.model.compute_logits(hidden)
        work.write(drafted)
        return {i: torch.stack(q) for i, q in qs.items()}

    def _follow_width(self, entries: list, ends: list) -> int | None:
        """The static follow-up's width W when every row is a decode-state follow-up of at most W
        positions with W positions before its end (FollowGraphs), else None (eager)."""
        if self.graphs is None or not self.graphs.capture_on or any(e is None for e in ends):
            return None
        width = pad_width(max(m for _, _, m in entries))
        if width is None or any(c + m < width for _, c, m in entries):
            return None
        return width

    def follow(self, scheduled: list[tuple[Request, int]], num_real: list[int], batch: ForwardBatch,
               hidden: torch.Tensor, emitted: dict[str, list[int]]) -> None:
        """Run the MTP layer over the positions this step made real (its KV there, and draft 1
        of each request that now decodes); `emitted`: each sampled request's new tokens."""
        entries, rows, next_ids, ends = [], [], [], []
        for i, (req, _) in enumerate(scheduled):
            c, new = req.num_computed_tokens, emitted.get(req.request_id)
            if new is None:  # a prefill chunk short of the prompt's end
                m, nxt = num_real[i], req.token_ids[c + 1:c + num_real[i] + 1]
            else:
                m, nxt = num_real[i] + len(new) - 1, req.token_ids[c + 1:c + num_real[i]] + new
            entries.append((req.block_table, c, m))
            rows.append(list(range(batch.query_start[i], batch.query_start[i] + m)))
            next_ids.append(nxt)
            ends.append(sum(map(len, next_ids)) - 1 if new is not None else None)
        width = self._follow_width(entries, ends)
        if width:
            b = self.graphs.stage(hidden, rows, next_ids, entries, width)
            got = self.graphs.run(b, width)
            if got is not None:
                out, logits = got
                for r, (req, _) in enumerate(scheduled):  # clones: the next replay overwrites them
                    self.last[req.request_id] = (out[r].clone(), logits[r].clone())
                return
        flat_rows = [x for rr in rows for x in rr]
        out = self._predict(hidden[to_device(flat_rows, self.device)],
                            [t for tt in next_ids for t in tt], entries)
        picks = [(req, e) for (req, _), e in zip(scheduled, ends) if e is not None]
        if picks:
            logits = self.model.compute_logits(out[[e for _, e in picks]])
            for r, (req, e) in enumerate(picks):
                self.last[req.request_id] = (out[e], logits[r])


@dataclass
class StepSample:
    """What `adapt` learns from one step: when it started, the k it asked of its `num_seqs`
    decoding sequences, the drafting's seconds, and per sequence the drafts it could take
    (None: not a decode step of those sequences alone) and the drafts accepted."""

    start: float
    k: int
    num_seqs: int
    draft_s: float = 0.0
    asked: list[int] | None = None
    accepted: dict[int, int] = field(default_factory=dict)  # scheduled index -> drafts accepted


class SpecDecoder:
    """The engine's speculative decoding: one drafter, k draft tokens, the acceptance rule."""

    def __init__(self, method: str, k: int, drafter, max_model_len: int,
                 synthetic_accept: float | None = None, device: torch.device | str = "cpu",
                 adaptive: bool = False) -> None:
        self.method, self.k, self.drafter = method, k, drafter  # k: the most drafts, with `adapt`
        self.adapt = DraftLength(k, drafting_costs=method != "ngram") if adaptive else None
        self.sample: StepSample | None = None  # the step in progress, measured for `adapt`
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self.draft_probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] of sampled drafts
        # a model drafter's tokens on the device this step: (flat [N], request id -> indices)
        self.drafted: tuple[torch.Tensor, dict[str, list[int]]] | None = None
        self.synthetic_accept = synthetic_accept  # bench only: forced acceptance (lowbit.engine.acceptance)
        self.spans = HostSpans()  # the engine's, set by it
        self.synthetic_draws = self.synthetic_host = None  # device / host (greedy steps) verdicts
        self.graph_argmax_steps = 0  # verify steps that read the HIDDEN graph's argmax alone
        if synthetic_accept is not None:
            self.synthetic_draws = torch.Generator(device=device).manual_seed(SYNTHETIC_SEED)
            self.synthetic_host = torch.Generator().manual_seed(SYNTHETIC_SEED)

    @property
    def needs_hidden(self) -> bool:
        return self.drafter.needs_hidden

    def plan(self, running: list[Request]) -> None:
        """Draft slots for every running request in decode state (module docstring, step 1)."""
        num_decoding = sum(map(_decoding, running))
        k_step, self.sample = self.k, None
        if self.adapt is not None and num_decoding:
            k_step = self.adapt.k_for(num_decoding)
            self.sample = StepSample(self.adapt.clock(), k_step, num_decoding)
        for req in running:
            k = min(k_step, self._room(req))
            ok = _decoding(req) and k > 0 and self.drafter.available(req)
            req.draft_token_ids = self.drafter.plan(req, k) if ok else []
            if ok and self.synthetic_accept is not None:  # every verify step carries k drafts
                req.draft_token_ids += [(req.draft_token_ids or req.token_ids)[-1]] * (k - len(req.draft_token_ids))

    def propose(self, scheduled: list[tuple[Request, int]], sampling, rows: list[int], device: torch.device,
                mode) -> None:
        """Cut drafts to the scheduled windows and let a model drafter fill them (step 2)."""
        num_real = [min(n, req.num_tokens - req.num_computed_tokens) for req, n in scheduled]
        for (req, n), real in zip(scheduled, num_real):
            del req.draft_token_ids[n - real:]
        work = Drafting([r for r, _ in scheduled], num_real, [len(r.draft_token_ids) for r, _ in scheduled],
                        rows, device, sampling, mode)
        t0 = self.adapt.clock() if self.sample is not None else 0.0
        qs = self.drafter.propose(work)
        self.draft_probs = {work.reqs[i].request_id: q for i, q in qs.items()}
        self.drafted = (work.flat, work.where) if work.flat is not None else None
        if self.sample is not None:
            self.sample.draft_s = self.adapt.clock() - t0
            decode = len(scheduled) == self.sample.num_seqs and all(
                _decoding(r) and m == 1 for (r, _), m in zip(scheduled, num_real))
            self.sample.asked = [min(self.sample.k, self._room(r)) for r, _ in scheduled] if decode else None

    def observe(self) -> None:
        """The engine has read this step's tokens: a decode step's wall-clock, drafting time
        and acceptance go to the draft length (lowbit.engine.draft_length)."""
        sample, self.sample = self.sample, None
        if sample is not None and sample.asked is not None:
            outcomes = [(a, sample.accepted.get(i, 0)) for i, a in enumerate(sample.asked)]
            self.adapt.record_step(sample.num_seqs, sample.k, self.adapt.clock() - sample.start,
                                   sample.draft_s, outcomes)

    def _room(self, req: Request) -> int:
        """Drafts a request can take: its output and the context end come first."""
        return min(req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens)

    def verify(self, scheduled: list[tuple[Request, int]], query_start: list[int], hidden: torch.Tensor,
               model: torch.nn.Module, sampling, rows: torch.Tensor, steps: torch.Tensor, mode,
               graph_rows: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The target's tokens for every request that caught up (step 3): returns (picks,
        emitted tokens per pick, logits [P, K1, V] for log-probabilities, or None where no
        pick asked for them and the verify graph's argmax was enough). graph_rows: (argmax [T'],
        logits [T', V]) of every row of the step, where the verify graph wrote them."""
        picks = [i for i, (r, n) in enumerate(scheduled) if r.num_computed_tokens + n == r.num_known_tokens]
        ks = [len(scheduled[i][0].draft_token_ids) for i in picks]
        K, dev = max(ks), hidden.device
        P = len(picks)
        flat = [query_start[i + 1] - 1 - k + min(j, k) for i, k in zip(picks, ks) for j in range(K + 1)]
        listed = self._draft_list(scheduled, picks, ks, K)
        greedy = not mode.random and not mode.penalties and not self._sampled_drafts(scheduled, picks)
        argmax, row_logits = graph_rows if graph_rows is not None else (None, None)
        if greedy and argmax is not None and not any(scheduled[i][0].params.logprobs is not None for i in picks):
            # the graph wrote every row's argmax: read it whole and pick the rows on the host
            drafts = None
            if self.drafted is not None:  # the drafter's device tokens at the listed indices
                drafts = self.drafted[0].index_select(0, to_device(listed, dev))
            self.spans.lap("logits")
            self.graph_argmax_steps += 1
            host = self._accept_on_host(argmax, drafts, listed, ks, K, rows_of=flat)
            return picks, self._emit(picks, ks, host), None
        # every host list goes up in one non-blocking copy: rows of the logits, picks, k, and
        # the drafts (host tokens: n-gram; else indices into the drafter's device tokens)
        up = to_device(flat + picks + ks + listed, dev)
        index, sel, num_drafts, drafts = up.split([P * (K + 1), P, P, P * K])
        if self.drafted is not None:  # indices into the drafter's tokens (its last entry: a pad 0)
            drafts = self.drafted[0].index_select(0, drafts)
        if row_logits is not None:  # the graph's logits of every row: gather the windows'
            logits = row_logits.index_select(0, index).view(P, K + 1, -1)
        else:
            logits = model.compute_logits(hidden[index]).view(P, K + 1, -1)
        self.spans.lap("logits")
        if greedy:
            host = self._accept_on_host(logits.argmax(-1).view(-1), drafts, listed, ks, K)
        else:
            q, sampled = self._draft_probs(scheduled, picks, K, logits.shape[-1], dev)
            forced = None
            if self.synthetic_draws is not None:
                forced = torch.rand(P, K, device=dev, generator=self.synthetic_draws) < self.synthetic_accept
            tokens, n = accept(logits, drafts.view(P, K), num_drafts, sampling, rows[sel], steps[sel],
                               mode, q, sampled, forced)
            self.spans.lap("accept")
            host = read_list(torch.cat((n[:, None], tokens), 1))  # the step's one wait
            self.spans.lap("read wait")
        return picks, self._emit(picks, ks, host), logits

    def _emit(self, picks: list[int], ks: list[int], host: list[list[int]]) -> list[list[int]]:
        """The tokens each pick emits from accept()'s rows [num_accepted, tokens...]; the
        acceptance statistics and the draft-length sample take the counts."""
        emitted = [row[1:row[0] + 2] for row in host]
        for k, row in zip(ks, host):
            if k:
                self.stats.record(k, row[0])
        if self.sample is not None:
            self.sample.accepted = {i: row[0] for i, row in zip(picks, host)}
        return emitted

    def _accept_on_host(self, target: torch.Tensor, drafts: torch.Tensor | None, listed: list[int],
                        ks: list[int], K: int, rows_of: list[int] | None = None) -> list[list[int]]:
        """Greedy rows, point-mass drafts, no penalties: the acceptance rule needs only the
        target's argmax at each position (lowbit.engine.acceptance: t_j == d_j, the first t_j
        that differs is the correction), so the device computes that and the host compares.
        One read (the argmax, and a model drafter's device drafts), no rule ops on the device
        and no sampler state to update. Synthetic verdicts come from a host generator.
        target: the argmax [P * K1] of the verify rows, or with rows_of (the rows' indices)
        the argmax of every row of the step. Returns accept()'s rows read back:
        [num_accepted, tokens...] per pick."""
        P, K1 = len(ks), K + 1
        self.spans.lap("accept")
        n_t = target.shape[0]
        got = read_list(target if self.drafted is None else torch.cat((target, drafts)))  # the step's one wait
        self.spans.lap("read wait")
        target_host = got[:n_t] if rows_of is None else [got[i] for i in rows_of]
        drafted = got[n_t:] if self.drafted is not None else listed
        forced = None
        if self.synthetic_host is not None:
            forced = (torch.rand(P, K, generator=self.synthetic_host) < self.synthetic_accept).tolist()
        rows = []
        for b, k in enumerate(ks):
            d, tb = drafted[b * K:b * K + K], target_host[b * K1:b * K1 + K1]
            n = 0
            while n < k and (forced[b][n] if forced is not None else tb[n] == d[n]):
                n += 1
            rows.append([n] + d[:n] + [tb[n]])
        return rows

    def _draft_list(self, scheduled, picks: list[int], ks: list[int], K: int) -> list[int]:
        """[P * K] per pick its drafts padded to K: the host's tokens, or with a model
        drafter's device tokens their indices in its flat tensor (its last entry is the pad 0;
        a request the drafter did not reach keeps its placeholder drafts, the pad too)."""
        if self.drafted is None:
            return [t for i, k in zip(picks, ks) for t in scheduled[i][0].draft_token_ids + [0] * (K - k)]
        flat, where = self.drafted
        pad = flat.shape[0] - 1
        out = []
        for i, k in zip(picks, ks):
            at = where.get(scheduled[i][0].request_id, [])[:k]
            out += at + [pad] * (K - len(at))
        return out

    def device_drafts(self, req: Request, n: int) -> list[int]:
        """Where the drafts in `req`'s window of n tokens sit in the drafter's device tokens
        (the last len(draft_token_ids) tokens of the window), [] without any."""
        if self.drafted is None:
            return []
        return self.drafted[1].get(req.request_id, [])[:len(req.draft_token_ids)]

    def _sampled_drafts(self, scheduled, picks: list[int]) -> bool:
        """Whether any pick's drafts were sampled (a distribution to accept against)."""
        return any(scheduled[i][0].request_id in self.draft_probs for i in picks)

    def _draft_probs(self, scheduled, picks: list[int], K: int, V: int, dev):
        ids = [scheduled[i][0].request_id for i in picks]
        if not K or not self._sampled_drafts(scheduled, picks):
            return None, None
        q = torch.zeros(len(picks), K, V, device=dev)
        for b, r in enumerate(ids):
            if r in self.draft_probs:
                got = self.draft_probs[r]
                q[b, :got.shape[0]] = got
        sampled = to_device([r in self.draft_probs for r in ids], dev, torch.bool)
        return q, sampled

    def follow(self, scheduled: list[tuple[Request, int]], batch: ForwardBatch, hidden: torch.Tensor,
               emitted: dict[str, list[int]]) -> None:
        """After a verify step: a drafter that reads the target's hidden states runs over the
        positions the step made real."""
        if self.drafter.needs_hidden:
            num_real = [min(n, r.num_tokens - r.num_computed_tokens) for r, n in scheduled]
            self.drafter.follow(scheduled, num_real, batch, hidden, emitted)

    def release(self, request_id: str) -> None:
        self.drafter.release(request_id)
        self.draft_probs.pop(request_id, None)


def make_spec_decoder(config, model: torch.nn.Module, kv_cache: PagedKVCache, device: torch.device,
                      draft: torch.nn.Module | None = None) -> SpecDecoder | None:
    """The engine's SpecDecoder from its config (None without speculation); `draft`: the
    model of --speculative-model, loaded by the engine before it sized the KV pool."""
    method = config.speculative_method
    if method is None:
        return None
    if config.parallel:
        raise LowbitError("speculative decoding runs in one process; drop --speculative-method or "
                          "the parallel sizes")
    if method == "ngram":
        drafter = NgramDrafter()
    elif method == "mtp":
        wanted = graphs_wanted(model, device, config.enforce_eager)
        drafter = MTPDrafter(model, kv_cache, device, config.max_num_seqs, config.max_model_len,
                             wanted is None and device.type == "cuda")
    else:
        if draft.config.vocab_size != model.config.vocab_size:
            raise LowbitError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) differs "
                              f"from the target's ({model.config.vocab_size}); give a draft with the "
                              "same tokenizer")
        draft.prepare_for_serving()
        wanted = graphs_wanted(draft, device, config.enforce_eager)
        if wanted is not None and device.type == "cuda":
            log.warning("draft chains run eagerly (slow): %s", wanted)
        drafter = ModelDrafter(draft, kv_cache, device, config.max_num_seqs, config.max_model_len, wanted is None)
    if config.speculative_synthetic_accept is not None:
        log.warning("synthetic acceptance: each draft is accepted with probability %g whatever the model "
                    "says; the emitted tokens are not the model's output (a benchmark of verify cost only)",
                    config.speculative_synthetic_accept)
    return SpecDecoder(method, config.num_draft_tokens, drafter, config.max_model_len,
                       config.speculative_synthetic_accept, device, config.speculative_adaptive)


def _decoding(req: Request) -> bool:
    """In decode state: all but the last token computed, and past the prompt."""
    return req.num_computed_tokens == req.num_tokens - 1 and req.num_output_tokens > 0
