"""CUDA graphs for decode-only steps: one graph per batch-size bucket.

A decode step of B sequences is padded up to the next bucket (1, 2, 4, 8, then multiples
of 16 up to --max-num-seqs); padding rows read and write the pool's scratch block, which
the block manager never hands out, and their outputs are dropped.
Capture records the model forward on static buffers (input ids, positions, slot mapping,
block tables, sequence lengths); replay copies the step's metadata into them. A bucket is
captured at its first decode step, so a run pays only for the batch sizes it uses (the
bucket list up to 256 sequences is 20 graphs of every layer).

A graph replays kernels with the arguments they had at capture, so it is only correct for
a model whose layers read the batch through those tensors alone. A model says so with
`supports_cuda_graphs = True` (its attention goes through the paged `attention` op); the
op's torch route still reads Python lengths, so graphs also need a graph-safe route to
serve decode (lowbit.kernels.attention_op.decode_graph_refusal). Each bucket's warm-up
step runs with torch's sync debug mode set to error: a layer that reads device values on
the host (the reference MoE route, which serves more tokens than the fused decode route
takes) makes that bucket run eagerly, with the reason logged once, instead of breaking
the capture; the other buckets keep their graphs.
"""

from __future__ import annotations

import logging

import torch

from lowbit.engine.batch import ForwardBatch

log = logging.getLogger("lowbit")


def graph_buckets(max_num_seqs: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    return small + list(range(16, max_num_seqs + 1, 16))


def graphs_wanted(model: torch.nn.Module, device: torch.device, enforce_eager: bool) -> str | None:
    """None when decode graphs can be used, else the reason they are off."""
    if enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda":
        return "not on CUDA"
    if not getattr(model, "supports_cuda_graphs", False):
        return "the model's attention reads per-sequence Python metadata"
    try:
        from lowbit.kernels.attention_op import decode_graph_refusal
    except ImportError as e:
        return f"the attention kernels cannot be imported ({e})"
    return decode_graph_refusal()


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache, max_num_seqs: int, max_blocks: int,
                 device: torch.device) -> None:
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.buckets = graph_buckets(max_num_seqs)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), kv_cache.scratch_row, dtype=torch.long, device=device)
        self.block_tables = torch.full((n, max_blocks), kv_cache.scratch_block, dtype=torch.int32,
                                       device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.eager: dict[int, str] = {}  # bucket -> why its steps run eagerly
        self.pool = None

    def _static_batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(self.positions[:b], list(range(b + 1)), [1] * b, [None] * b,
                            self.kv_cache, self.slot_mapping[:b], self.block_tables[:b],
                            self.seq_lens[:b])

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def ready(self, num_seqs: int) -> bool:
        """Whether a decode step of num_seqs sequences replays a graph; the first step of a
        bucket captures it, or records why that bucket runs eagerly."""
        b = self.bucket_for(num_seqs)
        if b is None or b in self.eager:
            return False
        if b not in self.graphs:
            reason = self.capture(b)
            if reason is not None:
                self.eager[b] = reason
                log.info("decode steps of up to %d sequences run eagerly: %s", b, reason)
                return False
        return True

    def capture(self, b: int) -> str | None:
        """Capture bucket b; or the reason its warm-up step cannot be captured."""
        batch = self._static_batch(b)
        reason = self._warm_up(b, batch)
        if reason is not None:
            return reason
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):  # one pool: buckets never replay at once
            self.hidden[b] = self.model(self.input_ids[:b], batch)
        self.pool = graph.pool()
        self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured the decode CUDA graph for %d sequences", b)
        return None

    def _warm_up(self, b: int, batch: ForwardBatch) -> str | None:
        """One eager step outside the graph; a host sync in it would break the capture."""
        torch.cuda.synchronize(self.device)
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self.model(self.input_ids[:b], batch)
        except RuntimeError as e:
            if "synchroniz" not in str(e):
                raise
            return f"a decode step of {b} sequences reads device values on the host ({e})"
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        return None

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        B = batch.num_seqs
        assert self.ready(B), f"no decode graph for {B} sequences: {self.eager.get(self.bucket_for(B))}"
        b = self.bucket_for(B)
        self.input_ids[:B].copy_(input_ids)
        self.positions[:B].copy_(batch.positions)
        self.slot_mapping.fill_(self.kv_cache.scratch_row)
        self.slot_mapping[:B].copy_(batch.slot_mapping)
        self.block_tables.fill_(self.kv_cache.scratch_block)
        self.block_tables[:B, :batch.block_tables.shape[1]].copy_(batch.block_tables)
        self.seq_lens.fill_(1)
        self.seq_lens[:B].copy_(batch.seq_lens)
        self.graphs[b].replay()
        return self.hidden[b][:B]
