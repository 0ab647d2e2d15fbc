"""--cuda-graph-capture start: every decode bucket and the prefill shapes are captured before
the first request, each on a padding-only step. On the CPU the graph holders are stand-ins
that run the captured step function eagerly where a capture would run its warm-up, so these
tests check what the capture's steps read and write (the capture itself: tests/gpu)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lowbit import LLM, SamplingParams
from lowbit.config import EngineConfig
from lowbit.engine.cuda_graphs import DecodeGraphs
from lowbit.engine.prefill_graphs import PrefillGraphs
from lowbit.engine.runner import NO_GRAPHS
from lowbit.engine.sampling import SampleMode
from lowbit.engine.staging import Padding, StepInputs
from lowbit.kernels import routes
from lowbit.kernels.attention import reference_paged_attention
from lowbit.server.launch import server_config

PROMPTS = ["Once upon a time there was a river town where the boats", "The river"]


class EagerDecode(DecodeGraphs):
    """Decode graphs whose capture runs the step once (the warm-up) and records the staged
    inputs it ran on; a replay runs the step again."""

    def capture(self, b: int, mode=None) -> str | None:
        self.staged.append((b, mode, {k: v.clone() for k, v in self.inputs.seqs(b).items()},
                            {k: v.clone() for k, v in self.inputs.tokens(b).items()}))
        self._step(b, mode)
        self.graphs[(b, mode)] = None
        return None

    def run(self, num_seqs: int, mode=None):
        logits = self._step(self.bucket_for(num_seqs), mode)
        return self.tokens[:num_seqs], logits[:num_seqs]


class EagerPrefill(PrefillGraphs):
    def capture(self, t: int, b: int, mode=None) -> str | None:
        self._outputs(self.model.config.vocab_size)
        self.staged.append((t, b, mode, {k: v.clone() for k, v in self.inputs.seqs(b).items()},
                            {k: v.clone() for k, v in self.inputs.tokens(t).items()}))
        self._step(t, b, mode)
        self.graphs[(t, b, mode)] = None
        return None

    def run(self, bucket, mode=None):
        t, b = bucket
        self._step(t, b, mode)
        self.replays += 1
        return self.tokens[:b], self.logits[:b]


@pytest.fixture
def device_read_attention(monkeypatch):
    """The torch attention route made to read every paged call's starts and lengths from the
    device tensors, as the graph-safe Triton routes do (a decode call: one token a sequence)."""
    route = routes.ops()["attention"].get("torch")
    run = route.run

    def device_run(call):
        if call.pool is None:
            return run(call)
        b = call.block_tables.shape[0]
        starts = call.query_start_dev.tolist() if call.query_start_dev is not None else list(range(b + 1))
        return reference_paged_attention(call.q, call.pool, call.block_tables, starts, call.seq_lens.tolist(),
                                         call.scale, call.window, call.sinks)

    monkeypatch.setattr(route, "run", device_run)


def eager_holders(llm: LLM, max_seqs: int, max_tokens: int, max_graphs: int = 96) -> SimpleNamespace:
    r = llm.engine.runner
    dec = EagerDecode(r.model, r.inputs, r.sampling, r.kv_cache, max_seqs, r.device)
    pre = EagerPrefill(r.model, r.inputs, r.sampling, r.kv_cache, max_tokens, max_seqs, r.device, dec,
                       max_graphs=max_graphs)
    dec.staged, pre.staged = [], []
    r.use_graphs((dec, pre))
    return SimpleNamespace(runner=r, dec=dec, pre=pre)


def test_a_startup_capture_touches_only_the_scratch_rows_and_gives_the_eager_tokens(device_read_attention):
    """Each capture step is padding only: every token writes the pool's scratch row, every
    sequence samples into the sampler's scratch row, so the pool's real blocks and the
    sampler state are as they were; afterwards a run replays (here: reruns) the captured
    shapes alone, with the tokens of an engine that never captured."""
    kw = dict(device="cpu", kv_cache_tokens=512, max_num_batched_tokens=16, max_num_seqs=4)
    sp = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    want = [o.outputs[0].token_ids for o in LLM("demo", **kw).generate(PROMPTS, sp)]
    llm = LLM("demo", **kw)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))  # the pool's layers exist now
    h = eager_holders(llm, max_seqs=4, max_tokens=16)
    cache, pad = h.runner.kv_cache, h.runner.inputs.pad
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for t in cache.k + cache.v:
            t[:cache.scratch_row].copy_(torch.randn(t[:cache.scratch_row].shape, generator=g))
    before = [t[:cache.scratch_row].clone() for t in cache.k + cache.v]
    modes = llm.engine.startup_modes()
    assert modes[0] == SampleMode() and len(modes) == 2 and modes[1].random  # greedy; the demo's default
    out = h.runner.capture_graphs(modes)

    assert out["decode"] == 2 * len(h.dec.buckets) == 2 * 3 and out["skipped"] is None
    assert [(b, m) for b, m, _, _ in h.dec.staged] == [(b, m) for m in modes for b in (1, 2, 4)]
    order = h.pre.capture_order()
    assert order == [(t, 1) for t in (2, 4, 8, 16)] + [(t, 2) for t in (2, 4, 8, 16)] + \
        [(t, 4) for t in (4, 8, 16)] + [(8, 5), (16, 5)]  # 5: four sequences and the padded prompt
    assert out["prefill"] == 2 * len(order) and [(t, b, m) for t, b, m, _, _ in h.pre.staged] == \
        [(t, b, m) for m in modes for t, b in order]
    for b, _, seqs, toks in h.dec.staged:
        assert toks["slot_mapping"].tolist() == [pad.scratch_row] * b
        assert seqs["rows"].tolist() == [pad.sampler_row] * b and seqs["query_start"].tolist() == list(range(b + 1))
    for t, b, _, seqs, toks in h.pre.staged:
        assert toks["slot_mapping"].tolist() == [pad.scratch_row] * t
        assert seqs["sample_rows"].tolist() == [pad.sampler_row] * b
        assert seqs["query_start"].tolist() == [0] + [t] * b and seqs["seq_lens"].tolist() == [t] + [1] * (b - 1)
    assert all(torch.equal(a, t[:cache.scratch_row]) for a, t in zip(before, cache.k + cache.v))

    shapes = set(h.dec.graphs) | set(h.pre.graphs)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
    assert got == want
    assert set(h.dec.graphs) | set(h.pre.graphs) == shapes  # no shape of the run was new


def test_the_prefill_limit_caps_a_startup_capture(device_read_attention):
    llm = LLM("demo", device="cpu", kv_cache_tokens=512, max_num_batched_tokens=16, max_num_seqs=4)
    h = eager_holders(llm, max_seqs=4, max_tokens=16, max_graphs=5)
    out = h.runner.capture_graphs([SampleMode()])
    assert out["prefill"] == 5 and list(h.pre.graphs) == [(*s, SampleMode()) for s in h.pre.capture_order()[:5]]


def test_a_startup_capture_leaves_room_for_the_modes_it_did_not_cover(device_read_attention, monkeypatch):
    from lowbit.engine import runner as runner_mod

    monkeypatch.setattr(runner_mod, "STARTUP_GRAPHS", 3)
    llm = LLM("demo", device="cpu", kv_cache_tokens=512, max_num_batched_tokens=16, max_num_seqs=4)
    h = eager_holders(llm, max_seqs=4, max_tokens=16, max_graphs=5)
    assert h.runner.capture_graphs([SampleMode()])["prefill"] == 3
    filters = SampleMode(random=True, filters=True)  # a top-p request's steps, later
    h.runner.inputs.stage({f: [] for f in StepInputs.FIELDS} | {"query_start": [0]}, [], pad_to=1, pad_tokens=16)
    with torch.inference_mode():  # as the runner's steps run
        assert h.pre.ready((16, 1), filters)
    assert (16, 1, filters) in h.pre.graphs and len(h.pre.graphs) == 4


def test_an_engine_with_host_hooks_captures_at_first_use():
    llm = LLM("demo", device="cpu", kv_cache_tokens=512, max_num_seqs=4)
    h = eager_holders(llm, max_seqs=4, max_tokens=16)
    h.runner.before_forward.append(lambda *a: None)
    out = h.runner.capture_graphs([SampleMode()])
    assert out["decode"] == out["prefill"] == 0 and "host hooks" in out["skipped"]
    assert not h.dec.graphs and not h.pre.graphs


def test_startup_modes_follow_the_generation_config():
    llm = LLM("demo", device="cpu", kv_cache_tokens=512, max_num_seqs=4)
    e = llm.engine
    e.loaded.generation_config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert e.startup_modes() == [SampleMode(), SampleMode(random=True, filters=True)]
    e.loaded.generation_config = {"temperature": 0.0}
    assert e.startup_modes() == [SampleMode()]
    e.loaded.generation_config = {"temperature": 0.7, "repetition_penalty": 1.1}  # penalties: first use
    assert e.startup_modes() == [SampleMode()]


def test_a_padding_only_step_stages_without_tables():
    inputs = StepInputs(32, 4, 3, Padding(scratch_row=99, scratch_block=7, sampler_row=5), torch.device("cpu"))
    empty = {f: [] for f in StepInputs.FIELDS} | {"query_start": [0]}
    inputs.stage(empty, [], pad_to=4, pad_tokens=16)
    inputs.upload()
    assert inputs.seqs(4)["seq_lens"].tolist() == [16, 1, 1, 1]
    assert inputs.block_tables[:4, :1].tolist() == [[7]] * 4


def test_serve_captures_at_start_and_the_others_at_first_use():
    assert EngineConfig().cuda_graph_capture == "auto"
    assert server_config(EngineConfig()).cuda_graph_capture == "start"
    assert server_config(EngineConfig(cuda_graph_capture="lazy")).cuda_graph_capture == "lazy"
    llm = LLM("demo", device="cpu", kv_cache_tokens=512, max_num_seqs=4, cuda_graph_capture="start")
    assert llm.engine.startup_capture is None  # no graphs on the CPU: nothing to capture
    assert llm.engine.runner.capture_graphs([SampleMode()])["skipped"] == NO_GRAPHS


def test_the_time_budget_bounds_a_startup_capture(device_read_attention, monkeypatch):
    """Past STARTUP_CAPTURE_SECONDS the capture takes no more prefill shapes (the decode
    buckets are always captured) and counts the ones left to their first step."""
    from lowbit.engine import runner as runner_mod

    llm = LLM("demo", device="cpu", kv_cache_tokens=512, max_num_batched_tokens=16, max_num_seqs=4)
    h = eager_holders(llm, max_seqs=4, max_tokens=16)
    monkeypatch.setattr(runner_mod, "STARTUP_CAPTURE_SECONDS", 0.0)
    out = h.runner.capture_graphs([SampleMode()])
    assert out["decode"] == len(h.dec.buckets) and out["prefill"] == 0
    assert out["prefill_left"] == len(h.pre.capture_order()) and not h.pre.graphs
    assert out["decode_seconds"] > 0 and out["slowest"][1].startswith("decode")
