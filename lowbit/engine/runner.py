"""ModelRunner: turns a SchedulerOutput into one model forward and the sampled tokens.

prepare: the scheduled (request, new tokens) pairs become the flat token list and a
ForwardBatch (positions, per-sequence slots over the paged cache, slot mapping, block
tables). forward: a decode-only batch replays a CUDA graph when graphs are on; anything
else runs eagerly. sample: logits only for the rows that need them (each request that
caught up with its known tokens, plus prompt rows of requests that asked for prompt
logprobs), penalties, the device sampler, and log-probabilities.

Seams: `before_forward` hooks see each batch and its token ids before the model runs
(an expert cache can prefetch the experts the step will route to; a speculative step can
run its drafter over the same batch). Speculative verification needs nothing else here:
its draft tokens are uncomputed tokens, and `sample` would then score every row of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lowbit.engine.batch import ForwardBatch
from lowbit.engine.cuda_graphs import DecodeGraphs, graphs_wanted
from lowbit.engine.paged_cache import PagedKVCache, SeqSlots
from lowbit.engine.request import Request, TokenLogprob
from lowbit.engine.sampling import penalize, sample, token_logprobs
from lowbit.engine.scheduler import SchedulerOutput

log = logging.getLogger("lowbit")


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> new token
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, device: torch.device,
                 max_num_seqs: int, max_model_len: int, enforce_eager: bool = False) -> None:
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.before_forward: list[Callable[[ForwardBatch, torch.Tensor], None]] = []
        self.graphs: DecodeGraphs | None = None
        reason = graphs_wanted(model, device, enforce_eager)
        if reason is None:  # each bucket is captured at its first decode step
            max_blocks = -(-max_model_len // kv_cache.block_size)
            self.graphs = DecodeGraphs(model, kv_cache, max_num_seqs, max_blocks, device)
        else:
            log.info("decode CUDA graphs off: %s", reason)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if sched.is_empty:
            return RunnerOutput()
        input_ids, batch = self.prepare(sched.scheduled)
        for hook in self.before_forward:
            hook(batch, input_ids)
        hidden = self.forward(input_ids, batch)
        return self.sample(sched.scheduled, batch, hidden)

    def prepare(self, scheduled: list[tuple[Request, int]]) -> tuple[torch.Tensor, ForwardBatch]:
        ids: list[int] = []
        slots: list[SeqSlots] = []
        bs = self.kv_cache.block_size
        for req, n in scheduled:
            start = req.num_computed_tokens
            ids.extend(req.token_ids[start:start + n])
            slots.append(SeqSlots.build(req.block_table, start, n, bs, self.device))
        batch = ForwardBatch.build([n for _, n in scheduled], [r.num_computed_tokens for r, _ in scheduled],
                                   slots, self.kv_cache, self.device)
        batch.slot_mapping = torch.cat([s.write_rows for s in slots])
        width = max(len(r.block_table) for r, _ in scheduled)
        tables = [r.block_table + [self.kv_cache.scratch_block] * (width - len(r.block_table))
                  for r, _ in scheduled]
        batch.block_tables = torch.tensor(tables, dtype=torch.int32, device=self.device)
        seq_lens = [r.num_computed_tokens + n for r, n in scheduled]
        batch.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=self.device)
        return torch.tensor(ids, dtype=torch.long, device=self.device), batch

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.graphs is not None and batch.mode.is_decode and self.graphs.ready(batch.num_seqs):
            return self.graphs.run(input_ids, batch)
        return self.model(input_ids, batch)

    def sample(self, scheduled: list[tuple[Request, int]], batch: ForwardBatch,
               hidden: torch.Tensor) -> RunnerOutput:
        out = RunnerOutput()
        rows, reqs = [], []
        for i, (req, n) in enumerate(scheduled):
            if req.num_computed_tokens + n == req.num_tokens:
                rows.append(batch.query_start[i + 1] - 1)
                reqs.append(req)
            if req.wants_prompt_logprobs:
                self._prompt_logprobs(req, n, batch.query_start[i], hidden, out)
        if not reqs:
            return out
        logits = self.model.compute_logits(hidden[rows])  # [R, V]
        params = [r.params for r in reqs]
        processed = penalize(logits, params, [(r.prompt_token_ids, r.output_token_ids) for r in reqs])
        tokens = sample(processed, params, [r.generator for r in reqs])  # [R]
        num_top = max((p.logprobs or 0) for p in params)
        if any(p.logprobs is not None for p in params):
            chosen, top_ids, top_lp = token_logprobs(logits, tokens, num_top)
            for j, req in enumerate(reqs):
                if req.params.logprobs is not None:
                    out.logprobs[req.request_id] = _entry(tokens[j], chosen[j], top_ids[j], top_lp[j],
                                                          req.params.logprobs)
        for req, tok in zip(reqs, tokens.tolist()):
            out.sampled[req.request_id] = tok
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


def _entry(token: torch.Tensor, chosen: torch.Tensor, top_ids: torch.Tensor, top_lp: torch.Tensor,
           k: int) -> TokenLogprob:
    return TokenLogprob(int(token), float(chosen),
                        list(zip(top_ids[:k].tolist(), top_lp[:k].tolist())))
