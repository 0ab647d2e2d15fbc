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


def test_sync_free_warm_up_names_a_host_read_and_restores_state(monkeypatch):
    """The warm-up both graph kinds run before capture: a step that synchronizes is refused
    with the reason, any other error propagates, and the sync debug mode and the sampler's
    counts are restored either way."""
    import pytest

    from lowbit.engine.cuda_graphs import sync_free_warm_up

    mode = {"now": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["now"])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.update(now=m))

    class Sampling:
        def __init__(self):
            self.counts, self.restored = 5, None

        def snapshot(self):
            return self.counts

        def restore(self, counts):
            self.restored = counts

    def syncing():
        assert mode["now"] == "error"
        raise RuntimeError("called a synchronizing CUDA operation")

    s = Sampling()
    why = sync_free_warm_up("cpu", s, syncing, "a decode step of 8 sequences")
    assert why.startswith("a decode step of 8 sequences reads device values on the host")
    assert mode["now"] == 0 and s.restored == 5
    assert sync_free_warm_up("cpu", s, lambda: None, "x") is None

    def broken():
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        sync_free_warm_up("cpu", s, broken, "x")
    assert mode["now"] == 0
