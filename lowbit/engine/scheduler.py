"""Scheduler: decides, each step, how many tokens of each request to compute.

One rule: every running request's computed tokens catch up toward its known tokens,
within `max_num_batched_tokens` per step and `max_num_seqs` running requests. A fresh
request's known tokens are its prompt, so its first steps are prefill chunks; after that
it knows one token more than it has computed (the last sampled one), so it decodes. A
speculative step fits the same rule: draft tokens (`draft_token_ids`) are known but
uncomputed, the step verifies them, and rejected ones are cut off again (their slots given
back: BlockManager.trim). So does async scheduling: a token sampled by the step still on the
device is known (`num_pending_tokens`) before the host has read it, so the next step
computes it and its KV slot is reserved here, from counts alone. A request whose pending
tokens reach its max_tokens or the context end is done: it keeps its seat, computes
nothing, and finishes when the host reads them.

Order is FIFO. Running requests go first, oldest first; when the pool runs out of blocks
the newest running request is preempted by recompute (its blocks freed, its tokens kept,
back to the head of the queue). Waiting requests are admitted in arrival order while the
budget, the seat count and the pool allow; the first that does not fit stops admission.
Requests that could never run (longer than the context or than the whole pool) are
refused in `add`, so nothing waits forever.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lowbit.engine.block_manager import BlockManager
from lowbit.engine.request import Request, RequestRejected, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestRejected for a request that could never be scheduled."""
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
                "completion). Shorten the prompt or lower max_tokens.",
                code="context_length_exceeded", param="max_tokens")
        pool = self.blocks.num_total_blocks * self.blocks.block_size
        if self.blocks.blocks_for(total) > self.blocks.num_total_blocks:
            raise RequestRejected(
                f"the request needs {total} tokens of KV cache but the whole pool holds {pool}; "
                "lower max_tokens or start the server with a larger KV cache",
                code="kv_cache_too_small", param="max_tokens")

    def add(self, req: Request) -> None:
        self.check_fits(req.num_prompt_tokens, req.max_tokens)
        self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Retire a request (done or aborted) and free its blocks at once."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self.blocks.free(req)
        req.draft_token_ids, req.num_pending_tokens = [], 0  # a step in flight's token for it is dropped
        req.status, req.finish_reason = RequestStatus.FINISHED, reason

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue, kept = list(self.running), []
        while queue and budget > 0:
            req = queue.pop(0)
            if self._ends_with_pending(req):
                kept.append(req)
                continue
            num_new = min(req.num_uncomputed_tokens, budget)
            target = req.num_computed_tokens + num_new
            while req is not None and not self.blocks.may_append(req, target):
                victim = queue.pop() if queue else req
                self._preempt(victim, out)
                req = None if victim is req else req
            if req is None:
                break
            self.blocks.append_slot(req, target)
            kept.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new
        self.running = kept + queue
        return budget

    def _ends_with_pending(self, req: Request) -> bool:
        """Its pending tokens reach max_tokens or the context: nothing is left to compute."""
        total = req.num_tokens + req.num_pending_tokens
        return req.num_pending_tokens > 0 and (
            total - req.num_prompt_tokens >= req.max_tokens or total >= self.max_model_len)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            assert not req.num_pending_tokens, "a preempted request is read back before it is readmitted"
            cached = self.blocks.match_prefix(req)
            num_cached = len(cached) * self.blocks.block_size
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.blocks.can_allocate(cached, num_cached + num_new):
                break
            self.waiting.popleft()
            self.blocks.allocate(req, cached, num_cached + num_new)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.blocks.free(req)
        req.draft_token_ids = []
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        out.preempted.append(req)
        self.num_preemptions += 1
