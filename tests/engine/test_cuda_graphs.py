"""Decode graph buckets: captured at first use, a bucket that cannot be captured runs eagerly
while the others keep their graphs (the capture itself needs CUDA: tests/gpu)."""

from types import SimpleNamespace

import torch

from lowbit.engine.cuda_graphs import DecodeGraphs, graph_buckets


class Recording(DecodeGraphs):
    """DecodeGraphs whose capture only records the bucket, refusing above `max_graph`."""

    def __init__(self, max_num_seqs: int, max_graph: int) -> None:
        cache = SimpleNamespace(scratch_row=0, scratch_block=0)
        super().__init__(torch.nn.Identity(), None, None, cache, max_num_seqs, torch.device("cpu"))
        self.max_graph, self.captured = max_graph, []

    def capture(self, b: int, mode=None) -> str | None:
        self.captured.append(b)
        if b > self.max_graph:
            return f"a decode step of {b} sequences reads device values on the host"
        self.graphs[(b, mode)] = object()
        return None


def test_buckets_up_to_max_num_seqs():
    assert graph_buckets(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert len(graph_buckets(256)) == 20 and graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


def test_only_the_buckets_a_run_uses_are_captured_once():
    g = Recording(max_num_seqs=256, max_graph=16)
    assert g.captured == []  # nothing at start-up
    assert g.ready(1) and g.ready(7) and g.ready(8) and g.ready(1)
    assert g.captured == [1, 8]


def test_a_bucket_that_syncs_runs_eagerly_and_the_others_keep_their_graphs(caplog):
    caplog.set_level("INFO", logger="lowbit")
    g = Recording(max_num_seqs=256, max_graph=16)
    assert not g.ready(32) and not g.ready(20)  # bucket 32: refused once, then remembered
    assert g.ready(8) and g.ready(16)
    assert g.captured == [32, 8, 16] and list(g.eager) == [(32, None)]
    assert "up to 32 sequences run eagerly" in caplog.text
    assert not g.ready(300)  # above --max-num-seqs: no bucket


class Stepping(Recording):
    """Recording whose step function writes row numbers as tokens and logits."""

    def _step(self, b: int, mode) -> torch.Tensor:
        self.stepped = (b, mode)
        self.tokens[:b].copy_(torch.arange(b))
        return torch.arange(b, dtype=torch.float32)[:, None].expand(b, 3)


def test_a_rerun_runs_the_captured_step_at_the_buckets_size():
    """A rejected replay's rerun runs the step the capture recorded, padded to the bucket
    (the attention's splits follow the rows), and returns the live rows only."""
    g = Stepping(max_num_seqs=256, max_graph=16)
    tokens, logits = g.rerun(5, "greedy")
    assert g.stepped == (8, "greedy")
    assert tokens.tolist() == list(range(5)) and logits.shape == (5, 3)
