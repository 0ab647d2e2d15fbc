"""LLMEngine: the serving engine. A batch's life, one `step()` at a time:

1. `add_request` checks the request (prompt inside the vocabulary and the context, the
   whole request able to fit the KV pool) and queues it: WAITING.
2. `schedule`: `Scheduler.schedule` picks, for each running request and then for waiting
   ones in arrival order, how many of its uncomputed tokens to compute this step, inside
   the token budget, the seat count and the free KV blocks (the BlockManager gives blocks,
   reuses cached prefix blocks, and preempts by recompute when the pool runs dry).
3. `run`: `ModelRunner.launch` lays the scheduled tokens out as one flat ForwardBatch over
   the paged cache (PagedKVCache), runs the model (a CUDA graph for decode-only steps where
   the model allows it), and samples a token for every request that caught up, on the
   device. The computed counts advance at once; a sampled token is pending until read.
4. `postprocess` reads a step's tokens back (one wait), registers full blocks in the prefix
   cache, appends the tokens, detokenizes, checks stop conditions, and returns one
   RequestDelta per request that produced something. With speculative decoding
   (lowbit.engine.speculative) a step starts by planning draft slots, and its update
   appends the accepted drafts too, rolls back the rejected ones and, with
   --speculative-adaptive, hands the step's wall-clock to the draft length. Finished or aborted
   requests give their blocks back at once: FINISHED.

Async scheduling (on by default, --no-async-scheduling turns it off): step N+1 is
scheduled and launched while the device still runs step N, and only then does the host
read and postprocess step N; a pending token reaches step N+1's input on the device. A
request that finished at step N, or was aborted, had step N+1 computed for it: that token
is dropped unread, so the request ends with what the synchronous engine would have sent.
A step runs synchronously (the one in flight read back first, itself read back at once)
when overlapping it is not safe: the reason is `async_off` for the whole engine
(speculative decoding, --record-routing, parallel workers, the flag) or counted per step in
`sync_steps` (prompt log-probabilities, computed on the host as the step runs).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from lowbit.checkpoint.loader import LoadedModel, load_model, zipf_router_
from lowbit.checkpoint.tokenizer import Tokenizer
from lowbit.config import EngineConfig
from lowbit.engine.batch import ForwardBatch
from lowbit.engine.block_manager import BlockManager
from lowbit.engine.detokenizer import IncrementalDetokenizer
from lowbit.engine.expert_cache import ExpertCache, RoutingRecorder, free_device_bytes, plan_slots
from lowbit.engine.metrics import EngineStats, HostSpans
from lowbit.engine.output import append_token, take_delta
from lowbit.engine.paged_cache import PagedKVCache, kv_bytes_per_token, parse_kv_dtype, pool_tokens
from lowbit.engine.prefill_graphs import STARTUP_CAPTURE_SECONDS
from lowbit.engine.request import Request, RequestDelta, RequestRejected
from lowbit.engine.runner import NO_GRAPHS, ModelRunner, PendingOutput, RunnerOutput
from lowbit.engine.sampling import SampleMode, SamplingParams, model_sampling_defaults
from lowbit.engine.scheduler import Scheduler, SchedulerOutput
from lowbit.engine.speculative import SpecDecoder, make_spec_decoder
from lowbit.errors import LowbitError
from lowbit.kernels import routes
from lowbit.kernels.routes import check_env

log = logging.getLogger("lowbit")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


SMALL_MATMUL = 1 << 20  # multiply-adds per token of a layer's widest matmul, under which one thread wins


def cpu_threads(requested: int, arch) -> int:
    """Intra-op threads for a CPU engine. A small model's ops take microseconds, less than
    handing work to a second thread: on a busy machine one thread decodes the demo model
    2.3x faster (docs/BENCHMARKS.md, CPU threads). Larger models keep torch's default."""
    if requested:
        return requested
    widest = arch.hidden_size * max(arch.intermediate_size, arch.moe_intermediate_size)
    return 1 if widest < SMALL_MATMUL else torch.get_num_threads()


def compute_dtype(dtype: str, device: torch.device) -> str:
    # bf16 on a GPU; float32 on the CPU, where bf16 matmuls are slow
    if dtype == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return dtype


@dataclass
class Flight:
    """A launched step whose output the host has not read yet."""

    sched: SchedulerOutput
    output: PendingOutput
    overlap: bool  # False: read back in the same `step()`

    def tokens_of(self, req: Request) -> int:
        return next((n for r, n in self.sched.scheduled if r is req), 0)


SYNC_PROMPT_LOGPROBS = "prompt logprobs (scored on the host while the step runs)"


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        config.validate()
        check_env()  # a misspelt LOWBIT_ROUTE_* fails before the model loads, not at its first call
        self.device = torch.device(config.device or default_device())
        dtype = compute_dtype(config.dtype, self.device)
        if loaded is None:
            config.check_loads_alone()
        self.loaded = loaded or load_model(config.model, dtype=dtype, device=str(self.device),
                                           random_weights=config.random_weights, config=config.config,
                                           quantization=config.quantization,
                                           experts_on_host=config.expert_offload)
        self.model, self.arch = self.loaded.model, self.loaded.config
        if config.router_zipf is not None:
            zipf_router_(self.model, config.router_zipf)
        self.model.prepare_for_serving()
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads(config.cpu_threads, self.arch))
        tok_dir = config.tokenizer or self.loaded.path
        self.tokenizer = Tokenizer(tok_dir) if tok_dir is not None else None
        self.config = config.resolved(self.arch.max_position_embeddings)
        self.max_model_len = self.config.max_model_len
        self.eos_ids = self._eos_ids()
        self.expert_cache = self._attach_expert_cache(next(self.model.parameters()).dtype)
        # a draft model loads before the KV pool is sized: its weights and its own pool (as many
        # blocks as the target's) come out of the same memory
        self.draft = None
        if self.config.speculative_method == "draft":  # validate(): it names --speculative-model
            self.draft = load_model(self.config.speculative_model, dtype=dtype, device=str(self.device)).model
        self._build_cache(next(self.model.parameters()).dtype)
        if self.expert_cache is not None:
            self.expert_cache.reset_stats()
        self._warn_if_pool_is_short()
        self.scheduler = Scheduler(self.blocks, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, self.config.max_num_seqs,
                                  self.max_model_len, self.config.enforce_eager or bool(self.config.record_routing),
                                  self.config.max_num_batched_tokens, self.config.prefill_graphs)
        if self.expert_cache is not None:
            self.runner.graph_check = self.expert_cache.graph_check
            self.runner.before_forward.append(self.expert_cache.before_forward)
            if self.runner.prefill_graphs is not None:  # a hooked step never pads to a bucket
                self.runner.prefill_graphs = None
                self.runner.prefill_graphs_off = ("the expert cache reads each prefill step's routing on "
                                                  "the host (its experts rarely fit the slots)")
                log.warning("prefill CUDA graphs are off (prefill steps run eagerly): %s",
                            self.runner.prefill_graphs_off)
        self.spec: SpecDecoder | None = make_spec_decoder(
            self.config, self.model, self.kv_cache, self.device,
            self.draft)
        self.runner.spec = self.spec
        self.spans = HostSpans()  # host time per step phase, off unless a profile asks
        self.runner.spans = self.spans
        if self.spec is not None:
            self.spec.spans = self.spans
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._deltas: list[RequestDelta] = []  # deltas ready before the next step returns
        self._ids = itertools.count()
        self._inflight: Flight | None = None  # the last step launched, unread
        self.async_off = self._async_refusal()  # None: steps overlap where safe
        if self.async_off is not None and self.config.async_scheduling:
            log.warning("async scheduling is off (each step waits for its tokens): %s", self.async_off)
        self.num_overlapped_steps = 0
        self.sync_steps: dict[str, int] = {}  # why a step ran synchronously -> steps
        self.startup_capture: dict | None = None  # --cuda-graph-capture start: what was captured
        if self.config.cuda_graph_capture == "start":
            self._capture_graphs()

    def startup_modes(self) -> list[SampleMode]:
        """The sampler modes a start-up capture covers: greedy (deterministic clients and the
        benches) and the mode of a request that names no sampling field (the model's
        generation_config over the API defaults), unless that one applies penalties (a
        penalties graph needs the count table that the first such request builds)."""
        try:
            default = SamplingParams(**model_sampling_defaults(self.loaded.generation_config))
        except (TypeError, ValueError, LowbitError):
            default = SamplingParams()
        modes = [self.runner.sampling.mode_for([SamplingParams(temperature=0.0)])]
        mode = self.runner.sampling.mode_for([default])
        if mode not in modes and not mode.penalties:
            modes.append(mode)
        return modes

    def _capture_graphs(self) -> None:
        r = self.runner.capture_graphs(self.startup_modes())
        if r["skipped"] == NO_GRAPHS:  # the CPU, --enforce-eager: nothing to capture
            return
        self.startup_capture = r
        if r["skipped"]:
            log.warning("CUDA graphs are captured at their first step, not at start: %s", r["skipped"])
            return
        log.info("captured %d decode and %d prefill CUDA graphs in %.1f s (decode %.1f s, prefill %.1f s; "
                 "slowest %.2f s: %s)", r["decode"], r["prefill"], r["seconds"], r["decode_seconds"],
                 r["prefill_seconds"], *r["slowest"])
        if r["prefill_left"]:
            log.info("%d prefill shapes are left to their first step: the start-up capture stops after "
                     "%.0f s", r["prefill_left"], STARTUP_CAPTURE_SECONDS)

    def _eos_ids(self) -> set[int]:
        ids = set(self.loaded.generation_config.get("eos_token_id") or []) | set(self.arch.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.token_id(self.tokenizer.eos_token) is not None:
            ids.add(self.tokenizer.token_id(self.tokenizer.eos_token))
        return ids

    def _async_refusal(self) -> str | None:
        """Why no step of this engine may overlap the next one (None: they may)."""
        if not self.config.async_scheduling:
            return "--no-async-scheduling"
        if self.spec is not None:
            return "speculative decoding (drafts are planned from the host's tokens)"
        if self.expert_cache is not None and self.expert_cache.recorder is not None:
            return "--record-routing writes each step's routing from the host"
        if self.config.parallel:
            return "parallel workers get each forward's inputs through the host"
        return None

    def _attach_expert_cache(self, model_dtype: torch.dtype) -> ExpertCache | None:
        """--expert-offload: experts to host memory, slots on the device, sized before the
        KV pool takes the rest; --record-routing: the trace recorder (docs/SERVING.md)."""
        cfg = self.config
        if not (cfg.expert_offload or cfg.record_routing):
            return None
        recorder = RoutingRecorder(cfg.record_routing) if cfg.record_routing else None
        cache = ExpertCache(self.model, self.device, cfg.expert_offload, cfg.expert_prefetch, recorder,
                            cfg.expert_prefetch_graphs)
        if cache.graph_prefetch:
            log.warning("--expert-prefetch-graphs is MEASURED-NEGATIVE: its pre-gating adds about 24 kernels "
                        "a MoE layer to each decode graph (0.61x C1 decode on an H100, docs/SERVING.md)")
        if cache.offload:
            kv_dtype = parse_kv_dtype(cfg.kv_cache_dtype, model_dtype)
            layers = getattr(self.model, "num_cache_layers", self.arch.num_layers)
            kv_reserve = kv_bytes_per_token(self.arch, kv_dtype, layers) * (cfg.kv_cache_tokens or self.max_model_len)
            first = cache.layers[0]
            slots = plan_slots(cfg, len(cache.layers), first.num_experts, first.expert_bytes,
                               free_device_bytes(cfg, self.device, kv_reserve))
            cache.allocate(slots, cfg.expert_cache_policy)
            rows = cache.resolve_rows
            if self.device.type == "cuda" and not cfg.enforce_eager and rows < cfg.max_num_seqs:
                log.warning("expert cache: decode graphs of up to %d sequences copy their own misses; "
                            "larger batches (up to --max-num-seqs %d) replay, and a step with a miss "
                            "runs again eagerly (slow). More slots (--expert-cache-slots, now %d) or a "
                            "lower --max-num-seqs avoid it", rows, cfg.max_num_seqs, slots)
        return cache

    def _build_cache(self, model_dtype: torch.dtype) -> None:
        cfg = self.config
        kv_dtype = parse_kv_dtype(cfg.kv_cache_dtype, model_dtype)
        layers = getattr(self.model, "num_cache_layers", self.arch.num_layers)
        extra = 0  # a draft model's pool bytes per token
        if self.draft is not None:
            extra = kv_bytes_per_token(self.draft.config, next(self.draft.parameters()).dtype,
                                       self.draft.num_cache_layers)
        num_blocks = pool_tokens(cfg, self.arch, kv_dtype, self.device, layers,
                                 self._profile_activation_bytes(), extra) // cfg.block_size
        if num_blocks < 1:
            raise LowbitError("the KV cache would hold no block; give it more memory or tokens")
        self.kv_cache = PagedKVCache(layers, num_blocks, cfg.block_size, kv_dtype, self.device)
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        mib = num_blocks * cfg.block_size * kv_bytes_per_token(self.arch, kv_dtype, layers, cfg.tensor_parallel_size) / 2**20
        log.info("KV cache: %d blocks x %d = %d tokens, %s, %.1f MiB", num_blocks, cfg.block_size,
                 self.kv_cache.num_tokens, str(kv_dtype).replace("torch.", ""), mib)

    def _warn_if_pool_is_short(self) -> None:
        """A pool shorter than the context refuses requests that would fit the context: say
        so at start-up. Requests that leave max_tokens out still run (check_request)."""
        if self.max_model_len > self.kv_cache.num_tokens:
            log.warning("the KV pool holds %d tokens, fewer than max_model_len %d: longer requests "
                        "are refused (kv_cache_too_small)", self.kv_cache.num_tokens, self.max_model_len)

    @torch.inference_mode()
    def _profile_activation_bytes(self) -> int:
        """Peak memory of the largest step on CUDA, from one dummy forward (0 elsewhere)."""
        if self.device.type != "cuda":
            return 0
        total, max_len = self.config.max_num_batched_tokens, self.max_model_len
        lens = [min(max_len, total - i) for i in range(0, total, max_len)]
        batch = ForwardBatch.build(lens, [0] * len(lens), None, None, self.device)
        ids = torch.zeros(total, dtype=torch.long, device=self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        with routes.start_up_probe("memory profile, no KV pool yet"):
            hidden = self.model(ids, batch)
            self.model.compute_logits(hidden[:self.config.max_num_seqs])
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del hidden
        torch.cuda.empty_cache()
        return peak

    # -- requests -------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raise RequestRejected if the request can never run; return its max_tokens."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty; give at least one token", param="prompt")
        vocab = self.arch.vocab_size
        bad = next((t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise RequestRejected(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise RequestRejected(f"stop token id {bad} is outside the vocabulary (0..{vocab - 1})",
                                  param="stop_token_ids")
        if n >= self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt has {n} tokens. Shorten the prompt.", code="context_length_exceeded", param="prompt")
        if params.max_tokens is None:  # as many as the context and the pool allow
            max_tokens = max(1, min(self.max_model_len, self.kv_cache.num_tokens) - n)
        else:
            max_tokens = params.max_tokens
        self.scheduler.check_fits(n, max_tokens)
        return max_tokens

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, prompt: str | None = None) -> Request:
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        max_tokens = self.check_request(prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params, max_tokens,
                      detokenizer=self._detokenizer(params), prompt=prompt)
        if req.wants_prompt_logprobs:
            req.prompt_logprobs = [None]  # the first prompt token has no context to score it
        self.scheduler.add(req)
        self.requests[request_id] = req
        self.stats.prompt_tokens_total += req.num_prompt_tokens
        return req

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)

    def abort(self, request_id: str) -> None:
        """Finish a request now and free its blocks; its last delta comes with the next step."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.finish(req, "abort")
        self.runner.release(request_id)
        self.stats.on_finish("abort", req.arrival_time, time.monotonic())
        self._deltas.append(take_delta(req, "abort"))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._deltas) or self._inflight is not None

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        self.spans.start()
        sched = self.schedule()
        previous = self.run(sched)
        return self.postprocess(previous)

    def schedule(self) -> SchedulerOutput:
        if self.spec is not None:
            self.spec.plan(self.scheduler.running)
            self.spans.lap("plan")
        sched = self.scheduler.schedule()
        self.spans.lap("schedule")
        return sched

    def run(self, sched: SchedulerOutput) -> Flight | None:
        """Launch the step; return the step launched before it, still unread. A step that
        may not overlap reads that one back first."""
        reason = self._sync_reason(sched)
        if reason is not None:
            self._drain()
        previous = self._inflight
        self._inflight = Flight(sched, self.runner.launch(sched), overlap=reason is None)
        self._advance(sched)
        return previous

    def postprocess(self, previous: Flight | None) -> list[RequestDelta]:
        """The deltas of the step before this one (read while the device runs this one), and
        of this one too when it does not overlap."""
        if previous is not None:
            result = previous.output.result()
            self.spans.lap("read wait")
            self._deltas += self._update(previous.sched, result)
            self.spans.lap("update")
        if all(r.is_finished for r, _ in self._inflight.sched.scheduled):
            self._inflight = None  # nothing of it would be emitted: not worth a wait
        elif not self._inflight.overlap:
            self._drain()
        deltas, self._deltas = self._deltas, []
        return deltas

    def _sync_reason(self, sched: SchedulerOutput) -> str | None:
        """Why this step may not overlap the next (None: it may), counted in the stats."""
        if sched.is_empty:
            return "idle"  # nothing to overlap with; not counted
        reason = self.async_off
        if reason is None and any(r.wants_prompt_logprobs and len(r.prompt_logprobs) < r.num_prompt_tokens
                                  for r, _ in sched.scheduled):
            reason = SYNC_PROMPT_LOGPROBS
        if reason is None:
            self.num_overlapped_steps += 1
        else:
            self.sync_steps[reason] = self.sync_steps.get(reason, 0) + 1
        return reason

    def _drain(self) -> None:
        """Read back the step in flight; its deltas go out with the next step's."""
        flight, self._inflight = self._inflight, None
        if flight is not None:
            result = flight.output.result()
            self.spans.lap("read wait")
            self._deltas += self._update(flight.sched, result)
            self.spans.lap("update")
            if self.spec is not None:
                self.spec.observe()

    def _advance(self, sched: SchedulerOutput) -> None:
        """Launched: the scheduled tokens count as computed, the sampled ones as pending."""
        self.stats.num_preemptions_total += len(sched.preempted)
        for req, n in sched.scheduled:
            if req.num_computed_tokens + n == req.num_known_tokens:
                req.num_pending_tokens += 1
            req.num_computed_tokens += n - len(req.draft_token_ids)  # a draft counts once accepted

    def update_from_output(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestDelta]:
        """The synchronous step's second half, for a caller that ran `runner.execute(sched)`."""
        self._advance(sched)
        deltas, self._deltas = self._deltas, []
        return deltas + self._update(sched, result)

    def _update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestDelta]:
        deltas = []
        now = time.monotonic()
        for req, _ in sched.scheduled:
            if req.is_finished:
                continue  # finished or aborted since this step launched: its token is dropped
            req.draft_token_ids = []
            req.prompt_logprobs.extend(result.prompt_logprobs.get(req.request_id, []))
            token = result.sampled.get(req.request_id)
            if token is None:
                self.blocks.cache_full_blocks(req)
                continue  # a prefill chunk short of the prompt's end
            req.num_pending_tokens -= 1
            reason = None
            for tok, logprob, drafted in self._emitted(req, token, result):
                self.stats.on_token(req.arrival_time, req.last_token_time, now)
                req.first_token_time = req.first_token_time or now
                req.last_token_time = now
                reason = append_token(req, tok, logprob, self.eos_ids, self.max_model_len)
                req.num_computed_tokens += drafted  # an accepted draft's K/V is in the cache
                if reason is not None:
                    break
            if reason is not None and self._inflight is not None:
                req.num_computed_tokens -= self._inflight.tokens_of(req)  # computed past its end: not cached
            self.blocks.cache_full_blocks(req)
            if reason is not None:
                self._finish(req, reason, now)
            elif self.spec is not None:
                self.blocks.trim(req, req.num_tokens)  # rejected drafts' slots go back
            deltas.append(take_delta(req, reason))
        return deltas

    @staticmethod
    def _emitted(req: Request, token: int, result: RunnerOutput) -> list[tuple[int, object, int]]:
        """(token, logprob, 1 if an accepted draft) for each token the step gave `req`."""
        rid = req.request_id
        accepted = result.accepted.get(rid, [])
        logprobs = result.accepted_logprobs.get(rid, [None] * len(accepted))
        return [(t, lp, 1) for t, lp in zip(accepted, logprobs)] + [(token, result.logprobs.get(rid), 0)]

    def _finish(self, req: Request, reason: str, now: float) -> None:
        self.scheduler.finish(req, reason)
        self.runner.release(req.request_id)
        self.requests.pop(req.request_id, None)
        self.stats.on_finish(reason, req.arrival_time, now)

    # -- state, for metrics and tests -----------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
