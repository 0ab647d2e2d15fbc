"""Prefill and mixed steps as CUDA graphs on the default routes: the same tokens as the
eager prefill, no host sync inside a replayed step, one graph per (token, sequence) bucket.

The model is the small random qwen3_moe of tests/gpu/test_attention_gpu.py (8 experts, top-2).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.engines import GPU_ONLY, cuda_engine, finish_without_syncs, run_staggered

pytestmark = GPU_ONLY


def _engine(path, **kw):
    return cuda_engine(path, **{**dict(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024), **kw})


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(32, 127, (int(torch.randint(5, 600, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("sampler", [dict(temperature=0.0), dict(temperature=0.9, seed=7, repetition_penalty=1.1)])
def test_prefill_graph_tokens_equal_eager_tokens(moe_dir, sampler):
    from lowbit import SamplingParams

    params = SamplingParams(max_tokens=6, ignore_eos=True, **sampler)
    prompts = _prompts(7, seed=1)
    outs = {}
    for on in (True, False):
        engine = _engine(moe_dir, prefill_graphs=on)
        assert (engine.runner.prefill_graphs is not None) == on, engine.runner.prefill_graphs_off
        outs[on] = run_staggered(engine, prompts, params)
        if on:
            pg = engine.runner.prefill_graphs
            assert not pg.eager, pg.eager
            assert pg.replays > 0 and any(b > 1 for _, b, _ in pg.graphs), pg.status()
    assert outs[True] == outs[False]


def test_replayed_prefill_steps_do_not_sync(moe_dir):
    """Four long prompts in 256-token steps; the second time round (same lengths, new
    tokens, so the same shapes) the chunk steps replay graphs under torch's sync debug
    mode set to error (the first step, which seats the requests, runs before it)."""
    from lowbit import SamplingParams

    engine = _engine(moe_dir)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(32, 127, (n,), generator=g).tolist() for n in (300, 410, 520, 333)]
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_unfinished():
        engine.step()
    pg = engine.runner.prefill_graphs
    captured, replays = set(pg.graphs), pg.replays
    reqs = [engine.add_request(p[::-1], params) for p in prompts]
    engine.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert set(pg.graphs) == captured and pg.replays >= replays + 4, pg.status()
    while engine.has_unfinished():
        engine.step()
    assert all(len(r.output_token_ids) == 4 for r in reqs)


def test_mla_prefill_is_captured_unless_torch_is_forced(monkeypatch):
    from lowbit.engine.prefill_graphs import prefill_graphs_wanted

    model = torch.nn.Module()
    model.attention_op = "latent_attention"
    monkeypatch.delenv("LOWBIT_ROUTE_LATENT_ATTENTION", raising=False)
    assert prefill_graphs_wanted(model) is None
    monkeypatch.setenv("LOWBIT_ROUTE_LATENT_ATTENTION", "torch")
    assert "torch" in prefill_graphs_wanted(model)


@pytest.mark.parametrize("synthetic", [None, 0.7])
def test_verify_steps_do_not_sync_before_their_read(moe_dir, synthetic):
    """n-gram speculation (k = 3) on a repeating prompt, the verify buckets captured by a
    first run: a second run of the same request (verify steps: the target's replay, logits,
    acceptance, the accepted tokens read through an event; plain decode steps where lookup
    finds nothing) goes under torch's sync debug mode set to error and, greedy, emits the same
    tokens. Synthetic acceptance makes every step a verify step that keeps drafts (its verdicts
    differ run to run, and so do its tokens)."""
    from lowbit import SamplingParams

    params = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0)
    prompt = list(range(40, 72)) * 4
    spec = _engine(moe_dir, speculative_method="ngram", num_speculative_tokens=3,
                   speculative_synthetic_accept=synthetic)
    warm = spec.add_request(prompt, params)
    while spec.has_unfinished():
        spec.step()
    req = spec.add_request(prompt, params)
    spec.step()  # the prompt (a prefill step)
    verified, accepted = spec.runner.spec_graph_steps, spec.spec.stats.num_accepted
    from_graph = spec.spec.graph_argmax_steps
    finish_without_syncs(spec)
    # greedy rows with point-mass drafts read the verify graph's argmax alone (no eager logits)
    assert spec.spec.graph_argmax_steps - from_graph == spec.runner.spec_graph_steps - verified
    if synthetic is not None:
        assert spec.runner.spec_graph_steps > verified + 5
        assert spec.spec.stats.num_accepted > accepted
    else:
        assert req.output_token_ids == warm.output_token_ids
    assert spec.blocks.num_free_blocks == spec.blocks.num_total_blocks


@pytest.mark.parametrize("spec", [False, True])
def test_host_spans_time_the_graph_launch_apart(moe_dir, spec):
    """A replayed step's cudaGraphLaunch is its own host phase ("replay"): a decode graph's in
    plain decoding, a verify step's HIDDEN graph's with synthetic speculation."""
    from lowbit import SamplingParams

    kw = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_synthetic_accept=0.7) if spec else {}
    eng = _engine(moe_dir, **kw)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    prompt = list(range(40, 72)) * 2
    for on in (False, True):  # the first run captures the graphs
        eng.spans.reset(on)
        eng.add_request(prompt, params)
        while eng.has_unfinished():
            eng.step()
    host = eng.spans.per_step_us()
    assert host.get("replay", 0) > 0 and host["launch"] >= 0, host
    assert (eng.runner.spec_graph_steps > 0) == spec
