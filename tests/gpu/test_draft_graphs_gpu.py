"""Draft chains captured as CUDA graphs (lowbit.engine.draft_graphs): the demo model drafted
by demo-draft at k = 3 on the GPU, after prompts with the catch-up in the graph. Each replay's drafts are the tokens the same chain gives
eagerly on the same static buffers, the chains replay (no eager fallback), and the greedy
output is the one without speculation up to the verify step's bf16 rounding (the check
here is that the chain, not the verify, is right)."""

from __future__ import annotations

import torch

from lowbit import LLM, SamplingParams
from tests.gpu.engines import GPU_ONLY, finish_without_syncs

pytestmark = GPU_ONLY


def test_demo_draft_chains_replay_what_they_compute_eagerly():
    llm = LLM("demo", device="cuda", speculative_method="draft", speculative_model="demo-draft",
              num_speculative_tokens=3, max_num_seqs=8, max_model_len=1024)
    chain = llm.engine.spec.drafter.chain
    assert chain is not None and chain.capture_on
    checked = []
    original = chain.run

    def run(b, n, mode, sampling, catch=0):
        toks, q = original(b, n, mode, sampling, catch)
        if (b, n, mode, catch) in chain.graphs:
            toks = toks.clone()
            again, _ = chain._step(b, n, mode, sampling, graph=True, catch=catch)  # same kernels, same inputs
            assert torch.equal(again, toks)
            checked.append((b, catch))
        return toks, q

    chain.run = run
    prompts = ["It is a truth universally acknowledged", "The king said unto them", "To be, or not to be"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 48 for o in outs)
    assert checked and chain.replays >= len(checked) and not chain.eager
    assert any(catch for _, catch in checked)  # the catch-up (2 or 4 tokens a row) in the graph
    stats = llm.engine.spec.stats
    assert 0 < stats.num_accepted <= stats.num_drafts


def test_v3_mtp_follow_ups_replay_what_they_compute_eagerly(tmp_path):
    """A small random DeepSeek-V3 (its MTP layer, k = 3) on the GPU: each MTP follow-up graph
    replay gives the output of the same static step run eagerly, follow-ups replay (no eager
    fallback), and the MTP layer's output at the last position is that of the layer run
    afresh over the whole sequence (bf16 tolerance)."""
    import json

    from lowbit.engine.batch import ForwardBatch
    from lowbit.engine.kv_cache import ContiguousKVCache
    from tests.models.test_random_weights import raw_config, shrink

    def mtp_reference(lm, ids):  # the MTP layer's output at the last position, afresh over the sequence
        with torch.inference_mode():
            cache = ContiguousKVCache(lm.num_cache_layers, 1, len(ids))
            batch = ForwardBatch.build([len(ids) - 1], [0], [0], cache, device="cuda")
            return lm.mtp.predict(lm(ids[:-1], batch), lm.model.embed_tokens(ids[1:]), batch)[-1]

    raw = shrink(raw_config("deepseek-ai__DeepSeek-V3"))
    raw.update(num_nextn_predict_layers=1, num_hidden_layers=2, max_position_embeddings=1024)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    llm = LLM("v3", random_weights=True, config=str(tmp_path / "config.json"), device="cuda",
              speculative_method="mtp", num_speculative_tokens=3, max_num_seqs=8, max_model_len=512,
              kv_cache_tokens=16384)
    eng = llm.engine
    graphs = eng.spec.drafter.graphs
    assert graphs is not None and graphs.capture_on
    checked, original = [], graphs.run

    def run(b, width):
        got = original(b, width)
        if got is not None and (b, width) in graphs.graphs:
            out = got[0].clone()
            again, _ = graphs._step(b, width)
            torch.testing.assert_close(again, out, rtol=0, atol=0)
            checked.append(b)
        return got

    graphs.run = run
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reqs = [eng.add_request(torch.randint(0, 256, (n,), generator=g).tolist(), sp) for n in (40, 9, 130)]
    for _ in range(8):
        eng.step()
    assert checked and graphs.replays >= len(checked) and not graphs.eager
    for r in reqs:
        if r.request_id in eng.spec.drafter.last:
            want = mtp_reference(eng.model, torch.tensor(r.token_ids, device="cuda")).float()
            got = eng.spec.drafter.last[r.request_id][0].float()
            assert (got - want).norm() / want.norm() < 0.02


def test_demo_draft_steps_do_not_sync_before_their_read():
    """The same prompt twice (greedy: the second run meets only captured shapes). In the
    second, every step from the first decode on (catch-up and chain replay, the drafts fed to
    the verify input on the device, the verify replay and acceptance, the one read through
    an event) runs under torch's sync debug mode set to error, with the same tokens."""
    llm = LLM("demo", device="cuda", speculative_method="draft", speculative_model="demo-draft",
              num_speculative_tokens=3, max_num_seqs=8, max_model_len=1024)
    eng = llm.engine
    ids = llm.prompts.encode("It is a truth universally acknowledged")
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = eng.add_request(ids, params)
    while eng.has_unfinished():
        eng.step()
    replays = eng.spec.drafter.chain.replays
    req = eng.add_request(ids, params)
    while req.num_output_tokens < 2:  # the prompt, then the first decode step (no drafts yet)
        eng.step()
    finish_without_syncs(eng)
    assert req.output_token_ids == first.output_token_ids
    assert eng.spec.drafter.chain.replays > replays and not eng.spec.drafter.chain.eager
