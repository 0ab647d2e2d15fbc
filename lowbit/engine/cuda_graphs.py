"""CUDA graphs for decode-only steps: one graph per (batch-size bucket, sampler mode).

A graph covers the whole step: embedding, every layer, the final norm, lm_head and the
sampler, from the token ids to the sampled tokens, with no host sync inside. It reads the
runner's persistent device buffers (lowbit.engine.staging.StepInputs: ids, positions,
slot mapping, block tables, sequence lengths, sampler rows and steps) and the sampler's
persistent state (lowbit.engine.sampling.SamplingState), and writes the tokens and the
logits into static outputs. A decode step of B sequences is padded up to the next bucket
(1, 2, 4, 8, multiples of 16, and --max-num-seqs itself); padded rows read and write the
pool's scratch block and the sampler's scratch row, and their outputs are dropped.

The sampler mode (greedy only; random; with top-k/p filters; with penalties) is a static
property of a graph, so a greedy batch never pays for a sort over the vocabulary. A bucket
is captured at its first decode step in a mode, so a run pays only for what it uses.

A graph replays kernels with the arguments they had at capture, so it is only correct for
a model whose layers read the batch through those tensors alone: a model says so with
`supports_cuda_graphs = True`, and the decode route of the attention op it calls (its
`attention_op`: `attention`, or `latent_attention` for MLA) must be graph-safe
(lowbit.kernels.attention_op.decode_graph_refusal). Each capture's warm-up step runs with
torch's sync debug mode set to error: a layer that reads device values on the host makes
that bucket run eagerly, with the reason as a WARNING (stderr), instead of breaking the
capture; the other buckets keep their graphs.

A replay the runner rejects (`graph_check`: an expert cache miss) is redone by `rerun`: the
same step function, eagerly, on the same static inputs, so that every kernel sees the
graph's shapes (bucket rows, the full block-table width) and rounds as a replay would.
"""

from __future__ import annotations

import logging

import torch

from lowbit.engine.batch import ForwardBatch
from lowbit.engine.staging import StepInputs
from lowbit.kernels.attention_op import decode_graph_refusal
from lowbit.kernels.sample_op import sample_rows

log = logging.getLogger("lowbit")


def graph_buckets(max_num_seqs: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    buckets = small + list(range(16, max_num_seqs + 1, 16))
    return buckets if buckets[-1] == max_num_seqs else buckets + [max_num_seqs]


def graphs_wanted(model: torch.nn.Module, device: torch.device, enforce_eager: bool) -> str | None:
    """None when decode graphs can be used, else the reason they are off."""
    if enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda":
        return "not on CUDA"
    if not getattr(model, "supports_cuda_graphs", False):
        return f"{type(model).__name__} reads per-sequence Python metadata in its attention"
    return decode_graph_refusal(getattr(model, "attention_op", "attention"))



def sync_free_warm_up(device: torch.device, sampling, step, what: str) -> str | None:
    """Run step() once eagerly under torch's sync debug mode "error", the sampler's counts
    restored after it (a warm-up's sampled tokens must not count; None: a step that samples
    nothing): None, or why the step cannot be captured (it reads device values on the host)."""
    torch.cuda.synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    counts = sampling.snapshot() if sampling is not None else None
    try:
        step()
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        return f"{what} reads device values on the host ({e})"
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        if sampling is not None:
            sampling.restore(counts)
    return None

class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, inputs: StepInputs, sampling, kv_cache,
                 max_num_seqs: int, device: torch.device) -> None:
        self.model, self.inputs, self.sampling, self.kv_cache = model, inputs, sampling, kv_cache
        self.device = device
        self.buckets = graph_buckets(max_num_seqs)
        n = self.buckets[-1]
        self.tokens = torch.zeros(n, dtype=torch.long, device=device)
        self.logits: dict[tuple, torch.Tensor] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.eager: dict[tuple, str] = {}  # (bucket, mode) -> why its steps run eagerly
        self.pool = None

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def ready(self, num_seqs: int, mode=None) -> bool:
        """Whether a decode step of num_seqs sequences replays a graph; the first step of a
        (bucket, mode) captures it, or records why it runs eagerly."""
        b = self.bucket_for(num_seqs)
        key = (b, mode)
        if b is None or key in self.eager:
            return False
        if key not in self.graphs:
            reason = self.capture(b, mode)
            if reason is not None:
                self.eager[key] = reason
                log.warning("decode steps of up to %d sequences run eagerly (slow): %s", b, reason)
                return False
        return True

    def _static_batch(self, b: int) -> ForwardBatch:
        tok, seq = self.inputs.tokens(b), self.inputs.seqs(b)
        return ForwardBatch(tok["positions"], list(range(b + 1)), [1] * b, [None] * b,
                            self.kv_cache, tok["slot_mapping"], self.inputs.block_tables[:b],
                            seq["seq_lens"])

    def _step(self, b: int, mode) -> torch.Tensor:
        """The captured work: ids -> hidden -> logits -> tokens (into self.tokens)."""
        batch = self._static_batch(b)
        hidden = self.model(self.inputs.tokens(b)["input_ids"], batch)
        logits = self.model.compute_logits(hidden)  # [b, V] float32
        seq = self.inputs.seqs(b)
        self.tokens[:b].copy_(sample_rows(logits, self.sampling, seq["rows"], seq["steps"], mode))
        return logits

    def capture(self, b: int, mode=None) -> str | None:
        """Capture bucket b in a sampler mode; or the reason its warm-up step cannot be."""
        reason = self._warm_up(b, mode)
        if reason is not None:
            return reason
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):  # one pool: graphs never replay at once
            self.logits[(b, mode)] = self._step(b, mode)
        self.pool = graph.pool()
        self.graphs[(b, mode)] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured the decode CUDA graph for %d sequences (%s)", b, mode)
        return None

    def _warm_up(self, b: int, mode) -> str | None:
        """One eager step outside the graph; a host sync in it would break the capture.
        The inputs hold the step about to run (padded to b), so the warm-up computes it too:
        its K/V writes are the ones the replay then rewrites with the same values."""
        return sync_free_warm_up(self.device, self.sampling, lambda: self._step(b, mode),
                                 f"a decode step of {b} sequences")

    def run(self, num_seqs: int, mode=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the step staged in the runner's inputs; (tokens [B], logits [B, V])."""
        b = self.bucket_for(num_seqs)
        assert (b, mode) in self.graphs, f"no decode graph for {num_seqs} sequences in {mode}"
        self.graphs[(b, mode)].replay()
        return self.tokens[:num_seqs], self.logits[(b, mode)][:num_seqs]

    def rerun(self, num_seqs: int, mode=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step staged in the runner's inputs eagerly, with the graph's shapes: the
        decode attention picks its splits from the rows and the table width, so a narrower
        batch would round differently from the replays around it. (tokens [B], logits [B, V])"""
        logits = self._step(self.bucket_for(num_seqs), mode)
        return self.tokens[:num_seqs], logits[:num_seqs]
