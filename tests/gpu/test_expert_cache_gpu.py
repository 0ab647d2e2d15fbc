"""Expert offload on CUDA: pinned host experts, side-stream copies, the decode graph's hit
path. Greedy tokens equal the resident engine's (graphs on, bf16); a step whose experts are
all resident replays the graph with no implicit host sync (sync debug mode "error")."""

from __future__ import annotations

import pytest
import torch

from lowbit.config import EngineConfig
from lowbit.engine.engine import LLMEngine
from lowbit.engine.sampling import SamplingParams
from lowbit.kernels.runtime import interpreting
from tests.engine.helpers import run_all, tokens_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET=1 is set: GPU tests run compiled kernels"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 9, [7, 9]]


def _engine(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model="demo", device="cuda", dtype="bfloat16", kv_cache_tokens=4096,
                                  max_num_seqs=8, **kw))


def _tokens(engine: LLMEngine, prompts) -> list[list[int]]:
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    out = run_all(engine)
    return [tokens_of(out[r.request_id]) for r in reqs]


@pytest.mark.parametrize("slots", [8, 3, 2])
@pytest.mark.parametrize("batch", [1, 4])
def test_offload_greedy_equals_resident(slots, batch):
    want = _tokens(_engine(), PROMPTS[:batch])
    engine = _engine(expert_offload=True, expert_cache_slots=slots)
    assert _tokens(engine, PROMPTS[:batch]) == want
    cache = engine.expert_cache
    t = cache.totals()
    assert t["misses"] > 0 and t["bytes_copied"] > 0
    assert cache.layers[0].host["w13.w"].is_pinned()
    assert t["graph_steps"] + t["graph_reruns"] > 0  # decode steps went through the graph


def test_resident_steps_replay_without_a_host_sync():
    engine = _engine(expert_offload=True, expert_cache_slots=8)
    _tokens(engine, PROMPTS)  # the bucket's graph captured
    for layer in engine.expert_cache.layers:
        layer.admit(list(range(layer.num_experts)))  # every expert resident
    for p in PROMPTS:
        engine.add_request(p, GREEDY)
    engine.step()  # prefill, eager
    before = engine.expert_cache.graph_steps
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert engine.expert_cache.graph_steps == before + 5
    assert engine.expert_cache.graph_reruns == 0
