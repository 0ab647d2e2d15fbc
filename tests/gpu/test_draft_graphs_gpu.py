"""Draft chains captured as CUDA graphs (lowbit.engine.draft_graphs): the demo model drafted
by demo-draft at k = 3 on the GPU, after prompts with the catch-up in the graph. Each replay's drafts are the tokens the same chain gives
eagerly on the same static buffers, the chains replay (no eager fallback), and the greedy
output is the one without speculation up to the verify step's bf16 rounding (the check
here is that the chain, not the verify, is right)."""

from __future__ import annotations

import torch

from lowbit import LLM, SamplingParams
from tests.gpu.engines import GPU_ONLY

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
    assert any(catch == 4 for _, catch in checked)  # the catch-up (k + 1 = 4 tokens a row) in the graph
    stats = llm.engine.spec.stats
    assert 0 < stats.num_accepted <= stats.num_drafts
