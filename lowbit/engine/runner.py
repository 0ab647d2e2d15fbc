"""ModelRunner: turns a SchedulerOutput into one model forward and the sampled tokens.

prepare: the scheduled (request, new tokens) pairs become the flat metadata of the step
(token ids, positions, slot mapping, block tables, sequence lengths, and for the sampler
each sequence's state row and step), staged in pinned host buffers and uploaded without a
blocking copy (lowbit.engine.staging). A token the previous step sampled and the host has
not read yet (a pending token, async scheduling) is staged as a placeholder and filled in
on the device from that step's sampled tokens. launch: a decode-only step replays one CUDA
graph from the token ids to the sampled tokens (embedding, every layer, final norm,
lm_head, sampler) when graphs are on (a replay `graph_check` rejects runs again eagerly with
the graph's shapes); anything else runs eagerly through the same sampler.
The sampled tokens (and log-probabilities, for the requests that asked) start their way
back through pinned buffers, two of them taken in turn so that a step can launch before
the one before it is read; `PendingOutput.result()` is the step's one wait. `execute` is
launch and wait in one.

Each running request owns a row of the SamplingState (its parameters, seed and the token
counts its penalties read) from its first scheduled step to its end or preemption. The
sampler counts each token on the device as it samples it, so the next step's penalties see
it before the host does.

Seams: `before_forward` hooks see each batch and its token ids before the model runs
(an expert cache can prefetch the experts the step will route to). With speculative
decoding (lowbit.engine.speculative) the drafter fills the step's draft tokens before
`prepare`, and a step with drafts (or an MTP drafter, which reads the hidden states) runs
eagerly through the acceptance rule (`_execute_spec`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lowbit.engine.batch import ForwardBatch
from lowbit.engine.cuda_graphs import DecodeGraphs, graphs_wanted
from lowbit.engine.metrics import HostSpans
from lowbit.engine.paged_cache import PagedKVCache, SeqSlots
from lowbit.engine.prefill_graphs import (
    HIDDEN,
    STARTUP_CAPTURE_SECONDS,
    STARTUP_GRAPHS,
    PrefillGraphs,
    prefill_graphs_wanted,
)
from lowbit.engine.request import Request, TokenLogprob
from lowbit.engine.sampling import SamplingState, token_logprobs
from lowbit.engine.scheduler import SchedulerOutput
from lowbit.engine.staging import Padding, StepInputs
from lowbit.kernels.sample_op import sample_rows

log = logging.getLogger("lowbit")
NO_GRAPHS = "no CUDA graphs (the CPU, --enforce-eager or a model that refuses them)"


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> new token
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)  # draft tokens kept, before `sampled`
    accepted_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


@dataclass
class PendingOutput:
    """A launched step's output on its way to the host: `result()` waits for it once."""

    out: RunnerOutput
    reqs: list[Request] = field(default_factory=list)  # the requests that sampled, in token order
    tokens: torch.Tensor | None = None  # [n] int64 host (pinned on CUDA)
    logprobs: tuple[torch.Tensor, ...] | None = None  # host (chosen [n], top ids [n, k], top [n, k])
    ready: torch.cuda.Event | None = None

    def result(self) -> RunnerOutput:
        if self.ready is not None:  # an event wait: the step's only one
            self.ready.synchronize()
        if self.tokens is not None:
            for j, (req, tok) in enumerate(zip(self.reqs, self.tokens.tolist())):
                self.out.sampled[req.request_id] = tok
                if self.logprobs is not None and req.params.logprobs is not None:
                    chosen, top_ids, top_lp = self.logprobs
                    self.out.logprobs[req.request_id] = _entry(tok, chosen[j], top_ids[j], top_lp[j],
                                                               req.params.logprobs)
            self.tokens = None
        return self.out


@dataclass
class Sampled:
    """The last launched step's sampled tokens on the device [n], and each request's index
    in them: where the next step's pending tokens come from."""

    tokens: torch.Tensor
    index: dict[str, int]


class LazySlots(Sequence):
    """Per-sequence SeqSlots built on first use: only the reference attention loop and MLA's
    latent cache read them, and building one uploads a block table."""

    def __init__(self, scheduled: list[tuple[Request, int]], block_size: int, device: torch.device):
        self._args = [(r.block_table, r.num_computed_tokens, n) for r, n in scheduled]
        self._built: dict[int, SeqSlots] = {}
        self.block_size, self.device = block_size, device

    def __len__(self) -> int:
        return len(self._args)

    def __getitem__(self, i):
        if i not in self._built:
            table, start, n = self._args[i]
            self._built[i] = SeqSlots.build(table, start, n, self.block_size, self.device)
        return self._built[i]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, device: torch.device,
                 max_num_seqs: int, max_model_len: int, enforce_eager: bool = False,
                 max_num_batched_tokens: int | None = None, prefill_graphs: bool = True) -> None:
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.before_forward: list[Callable[[ForwardBatch, torch.Tensor], None]] = []
        # after a graph replay: False sends the step to run again eagerly (an expert cache miss)
        self.graph_check: Callable[[], bool] | None = None
        self.sampling = SamplingState(max_num_seqs, model.config.vocab_size, device)
        self.spec = None  # lowbit.engine.speculative.SpecDecoder, set by the engine
        self.spans = HostSpans()  # the engine's, set by it
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        max_blocks = -(-max_model_len // kv_cache.block_size)
        max_tokens = max(max_num_batched_tokens or max_model_len, max_num_seqs)
        pad = Padding(kv_cache.scratch_row, kv_cache.scratch_block, self.sampling.scratch_row)
        # sequence rows for a full batch and a prefill bucket's padded prompt
        self.inputs = StepInputs(max_tokens, max_num_seqs + 1, max_blocks, pad, device)
        self._prefill_bucket: tuple[int, int] | None = None  # the staged step's prefill graph bucket
        self._unbucketed_warned = False
        self.graphs_off = graphs_wanted(model, device, enforce_eager)
        if self.graphs_off is not None and device.type == "cuda":
            log.warning("decode CUDA graphs are off (every decode step runs eagerly, slowly): %s",
                        self.graphs_off)
        self.spec_graph_steps = 0  # speculative verify steps replayed from a HIDDEN prefill graph
        self.prefill_graphs_off = self.graphs_off or ("--no-prefill-graphs" if not prefill_graphs
                                                      else prefill_graphs_wanted(model))
        if self.prefill_graphs_off is not None and self.graphs_off is None:
            log.warning("prefill CUDA graphs are off (prefill steps run eagerly, launch-bound): %s",
                        self.prefill_graphs_off)
        self._graph_sizes = (max_tokens, max_num_seqs)
        # each bucket is captured at its first step
        self.graphs, self.prefill_graphs = self._new_graphs(self.graphs_off is None,
                                                            self.prefill_graphs_off is None)
        pin = device.type == "cuda"
        # two read-back buffers, taken in turn: step N's is still unread when step N+1 launches
        self._tokens_host = [torch.zeros(max_num_seqs, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._tokens_ready = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._turn = 0
        self.last_sampled: Sampled | None = None

    # -- graph sets (a bench A/B of routes keeps one set per variant) ---------------------
    def _new_graphs(self, decode: bool, prefill: bool) -> tuple[DecodeGraphs | None, PrefillGraphs | None]:
        max_tokens, max_num_seqs = self._graph_sizes
        graphs = DecodeGraphs(self.model, self.inputs, self.sampling, self.kv_cache, max_num_seqs,
                              self.device) if decode else None
        pre = PrefillGraphs(self.model, self.inputs, self.sampling, self.kv_cache, max_tokens, max_num_seqs,
                            self.device, graphs) if prefill else None
        return graphs, pre

    def fresh_graphs(self) -> tuple[DecodeGraphs | None, PrefillGraphs | None]:
        """A new, empty pair of graph holders like the ones in use (None where those are off):
        graphs captured with other routes or switches live in their own pair."""
        return self._new_graphs(self.graphs is not None, self.prefill_graphs is not None)

    def use_graphs(self, pair: tuple[DecodeGraphs | None, PrefillGraphs | None]) -> None:
        self.graphs, self.prefill_graphs = pair

    @torch.inference_mode()
    def capture_graphs(self, modes: list) -> dict:
        """Capture now, before any request: every decode bucket in each sampler mode, then the
        prefill shapes (`PrefillGraphs.capture_order`) in each mode, up to STARTUP_GRAPHS of them
        (the graph limit keeps room for the modes a start does not cover) and while the
        capture has taken less than STARTUP_CAPTURE_SECONDS (a bounded start: the shapes left,
        "prefill_left", are captured at their first step).
        Each capture runs on a padding-only step (every row the scratch row, block and sampler
        row: nothing a request owns is read or written), so no request later waits for a
        capture of these shapes. {"decode": n, "prefill": n, "seconds": s, "decode_seconds": s,
        "prefill_seconds": s, "prefill_left": n, "slowest": [seconds, "kind shape mode"],
        "skipped": why}."""
        t0 = time.perf_counter()
        out = {"decode": 0, "prefill": 0, "seconds": 0.0, "decode_seconds": 0.0, "prefill_seconds": 0.0,
               "prefill_left": 0, "slowest": [0.0, ""], "skipped": None}

        def timed(kind: str, ready, shape, mode) -> int:
            t = time.perf_counter()
            n = ready(shape, mode)
            dt = time.perf_counter() - t
            out[f"{kind}_seconds"] += dt
            if dt > out["slowest"][0]:
                out["slowest"] = [dt, f"{kind} {shape} {mode}"]
            return n

        if self.graphs is None:
            out["skipped"] = NO_GRAPHS
            return out
        if self.before_forward:
            out["skipped"] = "steps have host hooks (an expert cache): their graphs are captured at first use"
            return out
        log.info("capturing CUDA graphs before serving (--cuda-graph-capture start): every decode bucket "
                 "and the prefill shapes, sampler modes %s", modes)
        empty = {f: [] for f in StepInputs.FIELDS} | {"query_start": [0]}
        for mode in modes:
            for b in self.graphs.buckets:
                self.inputs.stage(empty, [], pad_to=b)
                self.inputs.upload()
                out["decode"] += timed("decode", self.graphs.ready, b, mode)
        pre = self.prefill_graphs
        for mode in modes if pre is not None else []:
            for t, b in pre.capture_order():
                if len(pre.graphs) >= min(pre.max_graphs, STARTUP_GRAPHS):
                    break
                if time.perf_counter() - t0 >= STARTUP_CAPTURE_SECONDS:
                    out["prefill_left"] += 1
                    continue
                self.inputs.stage(empty, [], pad_to=b, pad_tokens=t)
                self.inputs.upload()
                out["prefill"] += timed("prefill", pre.ready, (t, b), mode)
        out["seconds"] = time.perf_counter() - t0
        return out

    # -- sampler rows ---------------------------------------------------------------------
    def _seat(self, req: Request) -> int:
        row = self.rows.get(req.request_id)
        if row is None:
            row = self.rows[req.request_id] = self.free_rows.pop()
            self.sampling.assign(row, req.params, req.prompt_token_ids, req.output_token_ids)
        return row

    def release(self, request_id: str) -> None:
        """The request ended or was preempted: its sampler row is free again."""
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.sampling.release(row)
            self.free_rows.append(row)
        if self.spec is not None:
            self.spec.release(request_id)

    # -- the step -------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run the step and wait for its output."""
        return self.launch(sched).result()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> PendingOutput:
        """Start the step on the device; its output comes back through `result()`."""
        for req in sched.preempted:
            self.release(req.request_id)
        if sched.is_empty:
            return PendingOutput(RunnerOutput())
        if self.spec is not None:
            self._propose(sched.scheduled)
            self.spans.lap("propose")
        input_ids, batch = self.prepare(sched.scheduled)
        self.spans.lap("prepare")
        self.last_sampled = None
        for hook in self.before_forward:
            hook(batch, input_ids)
        reqs = [r for r, n in sched.scheduled if r.num_computed_tokens + n == r.num_known_tokens]
        mode = self.sampling.mode_for([r.params for r in reqs])
        if self.spec is not None and (self.spec.needs_hidden or any(r.draft_token_ids for r in reqs)):
            return PendingOutput(self._execute_spec(sched.scheduled, input_ids, batch, reqs, mode))
        if reqs and self._graph_ready(batch, len(reqs), mode):
            self.spans.lap("launch")
            tokens, logits = self._replay(batch, mode)
            self.spans.lap("replay")
            out = RunnerOutput()
        elif self._prefill_bucket is not None and self.prefill_graphs.ready(self._prefill_bucket, mode):
            tokens, logits = self.prefill_graphs.run(self._prefill_bucket, mode)
            if not reqs:
                return PendingOutput(RunnerOutput())
            if len(reqs) < batch.num_seqs:  # the staged picks: the sequences that sample
                sel = self.inputs.seqs()["picks"][:len(reqs)]
                tokens, logits = tokens.index_select(0, sel), logits.index_select(0, sel)
            out = RunnerOutput()
        else:
            hidden = self.model(input_ids, batch)
            out = self._prompt_logprobs_all(sched.scheduled, batch, hidden)
            if not reqs:
                return PendingOutput(out)
            tokens, logits = self._sample_eager(sched.scheduled, batch, hidden, mode)
        pending = self._read_back(reqs, tokens, logits, out)
        self.spans.lap("launch")
        return pending

    def _replay(self, batch: ForwardBatch, mode) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the decode graph. When `graph_check` rejects it, the sampler's counts go
        back to before the replay and the step runs again eagerly with the graph's shapes
        (it rewrites the same KV slots, and rounds as an accepted replay would)."""
        counts = self.sampling.snapshot() if self.graph_check is not None else None
        tokens, logits = self.graphs.run(batch.num_seqs, mode)
        if self.graph_check is None or self.graph_check(self.graphs.bucket_for(batch.num_seqs)):
            return tokens, logits
        self.sampling.restore(counts)
        return self.graphs.rerun(batch.num_seqs, mode)

    def _graph_ready(self, batch: ForwardBatch, num_sampled: int, mode) -> bool:
        return (self.graphs is not None and batch.mode.is_decode and num_sampled == batch.num_seqs
                and self.graphs.ready(batch.num_seqs, mode))

    def prepare(self, scheduled: list[tuple[Request, int]]) -> tuple[torch.Tensor, ForwardBatch]:
        """Stage and upload the step's metadata; the batch's tensors are device views."""
        bs = self.kv_cache.block_size
        vals: dict[str, list[int]] = {f: [] for f in StepInputs.FIELDS}
        starts, context, pending, drafts = [0], [], [], []
        for req, n in scheduled:
            start = req.num_computed_tokens
            if req.num_pending_tokens and start + n > req.num_tokens:
                pending.append((starts[-1] + req.num_tokens - start, self._sampled_index(req)))
            if self.spec is not None and self.spec.drafted is not None:  # a model drafter's tokens, on the device
                first = starts[-1] + n - len(req.draft_token_ids)
                drafts += [(first + j, at) for j, at in enumerate(self.spec.device_drafts(req, n))]
            vals["input_ids"] += req.known_tokens(start, n)
            vals["positions"] += range(start, start + n)
            vals["slot_mapping"] += [req.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            vals["seq_lens"].append(start + n)
            row = self._seat(req)
            if start + n == req.num_known_tokens:
                vals["picks"].append(len(vals["rows"]))
            vals["rows"].append(row)
            vals["sample_rows"].append(row if start + n == req.num_known_tokens else self.sampling.scratch_row)
            vals["steps"].append(req.num_tokens + req.num_pending_tokens)  # the sampled token's index
            starts.append(starts[-1] + n)
            vals["last_index"].append(starts[-1] - 1)
            context.append(start)
        vals["query_start"] = starts
        self.spans.lap("lists")
        graph_bucket = self._bucket(scheduled, starts)
        self._prefill_bucket = self._prefill_bucket_for(scheduled, starts) if not graph_bucket else None
        pad_tokens = None
        if self._prefill_bucket is not None:
            pad_tokens, graph_bucket = self._prefill_bucket
        self.inputs.stage(vals, [r.block_table for r, _ in scheduled], pad_to=graph_bucket, pending=pending,
                          pad_tokens=pad_tokens, drafts=drafts)
        self.spans.lap("stage")
        self.inputs.upload()
        if pending:
            self.inputs.fill_pending(self.last_sampled.tokens)
        if drafts:
            self.inputs.fill_drafts(self.spec.drafted[0])
        self.spans.lap("upload")
        t, b = starts[-1], len(scheduled)
        tok, seq = self.inputs.tokens(t), self.inputs.seqs(b)
        width = max(len(r.block_table) for r, _ in scheduled)
        batch = ForwardBatch(tok["positions"], starts, context, LazySlots(scheduled, bs, self.device),
                             self.kv_cache, tok["slot_mapping"], self.inputs.block_tables[:b, :width],
                             seq["seq_lens"], query_start_dev=seq["query_start"])
        return tok["input_ids"], batch

    def _sampled_index(self, req: Request) -> int:
        """Where `req`'s pending token sits in the last step's sampled tokens."""
        assert req.num_pending_tokens == 1 and self.last_sampled is not None, \
            "a pending token comes from the step launched just before"
        return self.last_sampled.index[req.request_id]

    def _bucket(self, scheduled: list[tuple[Request, int]], starts: list[int]) -> int:
        """The graph bucket a decode step pads to (0: no padding)."""
        if self.graphs is None or starts[-1] != len(scheduled):
            return 0
        return self.graphs.bucket_for(len(scheduled)) or 0

    def _prefill_bucket_for(self, scheduled: list[tuple[Request, int]], starts: list[int]) -> tuple[int, int] | None:
        """The prefill graph bucket (T', B') a step that is not a pure decode pads to, or None
        when it runs eagerly: no prefill graphs, or a step that needs host work between layers
        (an expert cache's hooks, prompt log-probabilities). A speculative verify step takes
        the bucket's HIDDEN graph."""
        if self.prefill_graphs is None or self.before_forward:
            return None
        if starts[-1] == len(scheduled):  # one token a sequence: the decode graphs' shape
            return None
        if any(r.wants_prompt_logprobs for r, _ in scheduled):
            return None
        bucket = self.prefill_graphs.bucket_for(starts[-1], len(scheduled))
        if bucket is None and not self._unbucketed_warned:  # the scheduler's limits should prevent it
            self._unbucketed_warned = True
            log.warning("a step of %d tokens over %d sequences fits no prefill graph bucket: such steps run "
                        "eagerly (slow)", starts[-1], len(scheduled))
        return bucket

    def _sample_eager(self, scheduled: list[tuple[Request, int]], batch: ForwardBatch,
                      hidden: torch.Tensor, mode) -> tuple[torch.Tensor, torch.Tensor]:
        picks = [i for i, (r, n) in enumerate(scheduled) if r.num_computed_tokens + n == r.num_known_tokens]
        rows = [batch.query_start[i + 1] - 1 for i in picks]
        if len(rows) == batch.num_tokens:
            last = hidden
        else:
            last = hidden[torch.as_tensor(rows).to(self.device, non_blocking=True)]
        logits = self.model.compute_logits(last)  # [R, V]
        seq = self.inputs.seqs()
        sel = torch.as_tensor(picks).to(self.device, non_blocking=True)
        tokens = sample_rows(logits, self.sampling, seq["rows"][sel], seq["steps"][sel], mode)
        return tokens, logits

    # -- speculative decoding (lowbit.engine.speculative) ----------------------------------
    def _propose(self, scheduled: list[tuple[Request, int]]) -> None:
        rows = [self._seat(r) for r, _ in scheduled]
        self.spec.propose(scheduled, self.sampling, rows, self.device,
                          self.sampling.mode_for([r.params for r, _ in scheduled]))

    def _execute_spec(self, scheduled: list[tuple[Request, int]], input_ids: torch.Tensor,
                      batch: ForwardBatch, reqs: list[Request], mode) -> RunnerOutput:
        """A verify step: the target over every window (a HIDDEN prefill graph's replay where
        the step's bucket has one), the acceptance rule over the requests that caught up, then
        the drafter's follow-up over the positions made real."""
        graph_rows = None
        if self._prefill_bucket is not None and self.prefill_graphs.ready(self._prefill_bucket, HIDDEN):
            self.spans.lap("launch")
            hidden = self.prefill_graphs.run_hidden(self._prefill_bucket)[:batch.num_tokens]
            self.spans.lap("replay")
            graph_rows = self.prefill_graphs.verify_rows(self._prefill_bucket)
            self.spec_graph_steps += 1
        else:
            hidden = self.model(input_ids, batch)
        self.spans.lap("launch")
        out = self._prompt_logprobs_all(scheduled, batch, hidden)
        emitted: dict[str, list[int]] = {}
        if reqs:
            seq = self.inputs.seqs()
            picks, tokens, logits = self.spec.verify(scheduled, batch.query_start, hidden, self.model,
                                                     self.sampling, seq["rows"], seq["steps"], mode,
                                                     graph_rows=graph_rows)
            for b, (i, toks) in enumerate(zip(picks, tokens)):
                req = scheduled[i][0]
                emitted[req.request_id] = toks
                out.sampled[req.request_id], out.accepted[req.request_id] = toks[-1], toks[:-1]
                if req.params.logprobs is not None:
                    self._spec_logprobs(req, logits[b], toks, out)
        self.spec.follow(scheduled, batch, hidden, emitted)
        self.spans.lap("follow")
        return out

    def _spec_logprobs(self, req: Request, logits: torch.Tensor, tokens: list[int], out: RunnerOutput) -> None:
        k = req.params.logprobs
        chosen, top_ids, top_lp = token_logprobs(logits[:len(tokens)], torch.as_tensor(tokens, device=self.device), k)
        entries = [_entry(t, chosen[j], top_ids[j], top_lp[j], k) for j, t in enumerate(tokens)]
        out.accepted_logprobs[req.request_id], out.logprobs[req.request_id] = entries[:-1], entries[-1]

    def _read_back(self, reqs: list[Request], tokens: torch.Tensor, logits: torch.Tensor,
                   out: RunnerOutput) -> PendingOutput:
        """Start the copies of the tokens (and log-probabilities where asked) to the host,
        without waiting: a graph's logits and tokens are overwritten by its next replay, so
        everything read from them is queued now, ahead of the next step."""
        n = len(reqs)
        cuda = self.device.type == "cuda"
        host, ready = self._tokens_host[self._turn][:n], self._tokens_ready[self._turn]
        self._turn ^= 1
        host.copy_(tokens[:n], non_blocking=cuda)
        lp = None
        if any(r.params.logprobs is not None for r in reqs):
            num_top = max((r.params.logprobs or 0) for r in reqs)
            lp = tuple(t.to("cpu", non_blocking=cuda) for t in token_logprobs(logits[:n], tokens[:n], num_top))
        if ready is not None:
            ready.record()
        self.last_sampled = Sampled(tokens[:n], {r.request_id: j for j, r in enumerate(reqs)})
        return PendingOutput(out, reqs, host, lp, ready)

    def _prompt_logprobs_all(self, scheduled: list[tuple[Request, int]], batch: ForwardBatch,
                             hidden: torch.Tensor) -> RunnerOutput:
        out = RunnerOutput()
        for i, (req, n) in enumerate(scheduled):
            if req.wants_prompt_logprobs:
                self._prompt_logprobs(req, n, batch.query_start[i], hidden, out)
        return out

    def _prompt_logprobs(self, req: Request, n: int, row0: int, hidden: torch.Tensor,
                         out: RunnerOutput) -> None:
        """Row p of a prompt predicts prompt token p + 1; score those still unscored."""
        start = req.num_computed_tokens
        first, last = max(start, len(req.prompt_logprobs) - 1), min(start + n, req.num_prompt_tokens - 1)
        if first >= last:
            return
        logits = self.model.compute_logits(hidden[row0 + first - start:row0 + last - start])
        targets = torch.tensor(req.prompt_token_ids[first + 1:last + 1], device=self.device)
        k = req.params.prompt_logprobs
        chosen, top_ids, top_lp = token_logprobs(logits, targets, k)
        out.prompt_logprobs[req.request_id] = [
            _entry(targets[j], chosen[j], top_ids[j], top_lp[j], k) for j in range(len(targets))]


def _entry(token, chosen: torch.Tensor, top_ids: torch.Tensor, top_lp: torch.Tensor,
           k: int) -> TokenLogprob:
    return TokenLogprob(int(token), float(chosen),
                        list(zip(top_ids[:k].tolist(), top_lp[:k].tolist())))
