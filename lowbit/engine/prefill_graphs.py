"""CUDA graphs for prefill and mixed steps: one graph per (token bucket, sequence bucket, sampler mode).

A step of T new tokens over B sequences that is not a pure decode step (a prompt, a chunk of
one, chunks beside decodes) launches about 28 kernels a layer from Python; run eagerly, the
launches cost more than the kernels (H200, Qwen3-30B-A3B shape, bf16, 512 tokens: 18.5 ms
of kernels in a 71 ms step). A captured step replays them with no host work.

What a graph covers: embedding, every layer, the final norm, lm_head over each sequence's
last token (`last_index`), the sampler over those rows (`sample_rows`: a sequence that does
not sample this step samples into the scratch row, and its token is dropped). It reads the
runner's persistent buffers (lowbit.engine.staging.StepInputs) and writes tokens [B'] and
logits [B', V] into buffers shared by every prefill graph (a graph only lives until the
next replay reads its outputs, and graphs never replay at once).

Buckets: T pads to the next of 2, 4, 8, 16, ..., 512, then multiples of 512, then
--max-num-batched-tokens; B (plus one when T is padded: the padded tokens are one padded
prompt, see staging) pads to the next power of two, then --max-num-seqs. Nothing in a
layer reads a host length on this path: the attention op's prefill route takes the staged
query_start, and its grid depends on T and B alone (lowbit.kernels.attention,
_prefill_kernel); every other op's shapes are T, B and the weights'.

Speculative verify steps (lowbit.engine.speculative) replay graphs of the same buckets in
mode HIDDEN: embedding and every layer, writing the final hidden states [T', H] into one
buffer; up to VERIFY_ARGMAX_TOKENS tokens the graph also runs lm_head over every row and
writes the logits [T', V] and each row's argmax [T']. The argmax is all a greedy verify with
point-mass drafts reads (its acceptance then runs on the host, with no launch after the
replay); any other verify gathers its windows' rows of the logits. Above that size the
verify's logits over each window and its acceptance run after the replay.

A bucket is captured at its first step (a warm-up step first, with torch's sync debug
mode set to error, as the decode graphs do), or before the engine is ready with
--cuda-graph-capture start (`ModelRunner.capture_graphs`: padding-only steps of each shape,
in the order of `capture_order`, up to STARTUP_GRAPHS and while the capture has taken less
than STARTUP_CAPTURE_SECONDS). At most `max_graphs` are kept: past that,
steps of a new shape run eagerly, with a WARNING once. Steps that need host-side work
between layers run eagerly: prompt log-probabilities (every row's logits), speculative
verification before HIDDEN graphs existed, an expert cache (it routes on the host), and
models whose attention op would run a route that is not graph-safe (a forced torch route;
MLA's latent prefill is captured through triton_latent_prefill).
"""

from __future__ import annotations

import logging

import torch

from lowbit.engine.batch import ForwardBatch
from lowbit.engine.cuda_graphs import sync_free_warm_up
from lowbit.engine.staging import StepInputs
from lowbit.kernels.attention_op import prefill_graph_refusal
from lowbit.kernels.sample_op import sample_rows

log = logging.getLogger("lowbit")

MAX_GRAPHS = 160  # at the defaults (2,048 tokens, 256 sequences) there are 84 shapes a mode
# a start-up capture stops here, leaving the rest to shapes of sampler modes it did not cover
STARTUP_GRAPHS = 96
# and once its decode graphs are in, it captures prefill shapes only while the capture has
# taken less than this (seconds; the server's ready time at the Qwen3-30B-A3B shape had a
# 49 s capture of 112 graphs behind it with a cold Triton cache, H100): the shapes left are
# captured at their first step, as under --cuda-graph-capture lazy
STARTUP_CAPTURE_SECONDS = 30.0
HIDDEN = "hidden"  # the mode of a verify step's graph: hidden states out, no sampling
# HIDDEN graphs up to this many tokens also write every row's logits and argmax (lm_head over
# T' rows: a k = 3 verify at batch 1 runs 4; 64 rows of float32 logits at Qwen3's vocabulary
# are 39 MB, the buffer they share)
VERIFY_ARGMAX_TOKENS = 64


def token_buckets(max_tokens: int) -> list[int]:
    # 2, 4 and 8 are a speculative verify's sizes (k + 1 tokens a sequence): padded to 16, a
    # k = 3 verify at batch 1 ran 16 tokens through every MoE layer, reading their experts
    small = [t for t in (2, 4, 8, 16, 32, 64, 128, 256, 512) if t < max_tokens]
    return small + list(range(1024, max_tokens, 512)) + [max_tokens]


def seq_buckets(max_seqs: int) -> list[int]:
    out = [b for b in (1 << i for i in range(max_seqs.bit_length())) if b < max_seqs]
    return out + [max_seqs]


def prefill_graphs_wanted(model: torch.nn.Module) -> str | None:
    """None when prefill steps of `model` can be captured, else why not (decode graphs on)."""
    return prefill_graph_refusal(getattr(model, "attention_op", "attention"))


class PrefillGraphs:
    def __init__(self, model: torch.nn.Module, inputs: StepInputs, sampling, kv_cache, max_tokens: int,
                 max_num_seqs: int, device: torch.device, pool_owner, max_graphs: int = MAX_GRAPHS) -> None:
        self.model, self.inputs, self.sampling, self.kv_cache = model, inputs, sampling, kv_cache
        self.device, self.pool_owner, self.max_graphs = device, pool_owner, max_graphs
        self.token_buckets = token_buckets(max_tokens)
        # one more than --max-num-seqs: a full batch whose tokens pad to a bucket needs the padded
        # tokens' own sequence (without it such steps of a full batch ran eagerly, launch-bound)
        self.seq_buckets = seq_buckets(max_num_seqs + 1)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.eager: dict[tuple, str] = {}  # (T', B', mode) -> why its steps run eagerly
        self.full = False  # max_graphs reached (warned once)
        self.replays = 0
        self.tokens: torch.Tensor | None = None  # [max B'] sampled tokens of the last replay
        self.logits: torch.Tensor | None = None  # [max B', V] float32
        self.hidden: torch.Tensor | None = None  # [max T', H]: HIDDEN graphs' output
        self.argmax: torch.Tensor | None = None  # [VERIFY_ARGMAX_TOKENS]: their rows' argmax
        self.verify_logits: torch.Tensor | None = None  # [VERIFY_ARGMAX_TOKENS, V] float32

    def bucket_for(self, num_tokens: int, num_seqs: int) -> tuple[int, int] | None:
        """(T', B') a step of num_tokens over num_seqs pads to, or None (too large)."""
        t = next((x for x in self.token_buckets if x >= num_tokens), None)
        if t is None:
            return None
        b = next((x for x in self.seq_buckets if x >= num_seqs + (t > num_tokens)), None)
        return None if b is None else (t, b)

    def capture_order(self) -> list[tuple[int, int]]:
        """Every (T', B') a step that is not a pure decode can pad to, fewest sequences first
        (the order a start-up capture takes them in: the shapes of one prompt arriving beside
        few decodes before those of large bursts). Such a step has more tokens than
        sequences, so B' <= T'."""
        return [(t, b) for b in self.seq_buckets for t in self.token_buckets if b <= t]

    def ready(self, bucket: tuple[int, int], mode=None) -> bool:
        """Whether the step staged for `bucket` replays a graph (capturing it first if new)."""
        key = (*bucket, mode)
        if key in self.graphs:
            return True
        if key in self.eager:
            return False
        if len(self.graphs) >= self.max_graphs:
            if not self.full:
                self.full = True
                log.warning("%d prefill CUDA graphs are captured (the limit): prefill steps of new "
                            "shapes run eagerly (slow), e.g. %d tokens over %d sequences", self.max_graphs, *bucket)
            return False
        reason = self.capture(*bucket, mode)
        if reason is not None:
            self.eager[key] = reason
            log.warning("prefill steps of up to %d tokens over %d sequences run eagerly (slow): %s",
                        *bucket, reason)
            return False
        return True

    def _step(self, t: int, b: int, mode) -> None:
        """The captured work: ids -> hidden -> last rows' logits -> tokens."""
        tok, seq = self.inputs.tokens(t), self.inputs.seqs(b)
        batch = ForwardBatch(tok["positions"], [0] + [t] * b, [0] * b, [None] * b, self.kv_cache,
                             tok["slot_mapping"], self.inputs.block_tables[:b], seq["seq_lens"],
                             query_start_dev=seq["query_start"])
        hidden = self.model(tok["input_ids"], batch)
        if mode == HIDDEN:
            if self.hidden is None or self.hidden.dtype != hidden.dtype:
                if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise AssertionError("the hidden buffer is allocated in the warm-up")
                self.hidden = torch.zeros(self.token_buckets[-1], hidden.shape[1], dtype=hidden.dtype,
                                          device=self.device)
            self.hidden[:t].copy_(hidden)
            if t <= VERIFY_ARGMAX_TOKENS:
                logits = self.model.compute_logits(hidden)  # [t, V]
                if self.argmax is None:
                    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
                        raise AssertionError("the verify buffers are allocated in the warm-up")
                    self.argmax = torch.zeros(VERIFY_ARGMAX_TOKENS, dtype=torch.long, device=self.device)
                    self.verify_logits = torch.zeros(VERIFY_ARGMAX_TOKENS, logits.shape[1],
                                                     dtype=logits.dtype, device=self.device)
                self.verify_logits[:t].copy_(logits)
                self.argmax[:t].copy_(logits.argmax(-1))
            return
        logits = self.model.compute_logits(hidden.index_select(0, seq["last_index"]))  # [b, V] float32
        if self.logits is None or self.logits.shape[1] != logits.shape[1]:
            raise AssertionError("output buffers are allocated before the warm-up")
        self.logits[:b].copy_(logits)
        self.tokens[:b].copy_(sample_rows(logits, self.sampling, seq["sample_rows"], seq["steps"], mode))

    def _outputs(self, vocab: int) -> None:
        if self.logits is None:
            n = self.seq_buckets[-1]
            self.logits = torch.zeros(n, vocab, dtype=torch.float32, device=self.device)
            self.tokens = torch.zeros(n, dtype=torch.long, device=self.device)

    def capture(self, t: int, b: int, mode=None) -> str | None:
        self._outputs(self.model.config.vocab_size)
        reason = self._warm_up(t, b, mode)
        if reason is not None:
            return reason
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool_owner.pool):
                self._step(t, b, mode)
        except AssertionError as e:  # a route that reads host lengths was picked in capture
            return f"a prefill step of {t} tokens cannot be captured ({e})"
        self.pool_owner.pool = graph.pool()
        self.graphs[(t, b, mode)] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured the prefill CUDA graph for %d tokens over %d sequences (%s)", t, b, mode)
        return None

    def _warm_up(self, t: int, b: int, mode) -> str | None:
        """One eager step with the bucket's shapes: it computes the staged step (the replay
        then rewrites the same K/V), and a host sync in it would break the capture."""
        return sync_free_warm_up(self.device, self.sampling, lambda: self._step(t, b, mode),
                                 f"a prefill step of {t} tokens")

    def run(self, bucket: tuple[int, int], mode=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the staged step; (tokens [B'], logits [B', V]) of every padded sequence."""
        t, b = bucket
        self.graphs[(t, b, mode)].replay()
        self.replays += 1
        return self.tokens[:b], self.logits[:b]

    def run_hidden(self, bucket: tuple[int, int]) -> torch.Tensor:
        """Replay the staged verify step's HIDDEN graph; the hidden states [T', H]."""
        t, b = bucket
        self.graphs[(t, b, HIDDEN)].replay()
        self.replays += 1
        return self.hidden[:t]

    def verify_rows(self, bucket: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(argmax [T'], logits [T', V]) of every row that the last HIDDEN replay of `bucket`
        wrote, or None where its graph does not (more than VERIFY_ARGMAX_TOKENS tokens)."""
        t = bucket[0]
        if t > VERIFY_ARGMAX_TOKENS or self.argmax is None:
            return None
        return self.argmax[:t], self.verify_logits[:t]

    def status(self) -> str:
        shapes = sorted({(t, b) for t, b, _ in self.graphs})
        text = f"prefill CUDA graphs on ({self.replays} replays; captured (tokens, seqs): {shapes or 'none yet'})"
        if self.eager:
            text += "; eager: " + "; ".join(f"{t}x{b}: {why}" for (t, b, _), why in sorted(self.eager.items(), key=str))
        if self.full:
            text += f"; limit of {self.max_graphs} graphs reached (new shapes eager)"
        return text
