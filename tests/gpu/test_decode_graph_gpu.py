"""The decode step as one CUDA graph on the default routes: no host sync inside a step at
any batch size (torch's sync debug mode set to "error" around whole engine steps), every
sampler mode captured, and the same tokens as the eager engine.

The model is a small random qwen3_moe (8 experts, top-2): batches above 16 sequences take
the grouped MoE route inside the graph, smaller ones the fused decode route.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.engines import GPU_ONLY, cuda_engine

pytestmark = GPU_ONLY


def _engine(path, **kw):
    return cuda_engine(path, **{**dict(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=512), **kw})


def _into_decode(engine, n: int, params) -> list:
    g = torch.Generator().manual_seed(n)
    reqs = [engine.add_request(torch.randint(32, 127, (9 + i,), generator=g).tolist(), params)
            for i in range(n)]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        engine.step()
    return reqs


SAMPLERS = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=0.9, seed=3),
    "filters": dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=4),
    "penalties": dict(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5,
                      frequency_penalty=0.3, seed=5),
}


@pytest.mark.parametrize("batch", [1, 3, 20, 40])
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_decode_steps_do_not_sync_inside(moe_dir, batch, sampler):
    from lowbit import SamplingParams

    engine = _engine(moe_dir)
    assert engine.runner.graphs is not None, engine.runner.graphs_off
    reqs = _into_decode(engine, batch, SamplingParams(max_tokens=40, ignore_eos=True, **SAMPLERS[sampler]))
    engine.step()  # captures this bucket and mode (the capture synchronizes by design)
    before = [r.num_tokens for r in reqs]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [r.num_tokens - b for r, b in zip(reqs, before)] == [4] * batch
    graphs = engine.runner.graphs
    assert not graphs.eager, graphs.eager
    assert {b for b, _ in graphs.graphs} == {graphs.bucket_for(batch)}
    vocab = engine.arch.vocab_size
    assert all(0 <= t < vocab for r in reqs for t in r.output_token_ids)


def test_graph_tokens_equal_eager_tokens(moe_dir):
    """Greedy and seeded sampling give the same tokens replayed from graphs as run eagerly."""
    from lowbit import SamplingParams

    outs = {}
    for eager in (False, True):
        engine = _engine(moe_dir, enforce_eager=eager)
        assert (engine.runner.graphs is None) == eager
        reqs = _into_decode(engine, 3, SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.0))
        reqs += _into_decode(engine, 2, SamplingParams(max_tokens=9, ignore_eos=True, temperature=1.0, seed=11))
        while engine.has_unfinished():
            engine.step()
        outs[eager] = [r.output_token_ids for r in reqs]
    assert outs[False] == outs[True]
