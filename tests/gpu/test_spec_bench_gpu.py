"""The speculative bench's verify-cost table on a CUDA GPU (lowbit.bench.spec.verify_costs):
each T is a CUDA graph replay of the target's forward and logits, as the engine's verify
steps are, and the replay computes what the eager forward does on the same inputs."""

from __future__ import annotations

import torch

from lowbit import LLM, SamplingParams
from lowbit.bench.spec import VERIFY_TOKENS, _forward_runner, verify_costs
from lowbit.engine.draft_graphs import flat_batch
from tests.gpu.engines import GPU_ONLY

pytestmark = GPU_ONLY


def test_verify_costs_replay_graphs_that_match_the_eager_forward():
    llm = LLM("demo", device="cuda", max_num_seqs=4, max_model_len=1024)
    prompt = llm.engine.tokenizer.encode("It is a truth universally acknowledged that")
    rows = verify_costs(llm, prompt, 2)
    assert [r["T"] for r in rows] == list(VERIFY_TOKENS)
    assert all(r["how"] == "graph" and r["s"] > 0 for r in rows), rows
    eng = llm.engine
    req = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    while not req.num_output_tokens:
        eng.step()
    eng.blocks.append_slot(req, req.num_tokens + 4)
    with torch.inference_mode():
        ids = torch.as_tensor(req.token_ids[-1:] * 4, device=eng.device)
        batch = flat_batch([(req.block_table, req.num_tokens - 1, 4)], eng.kv_cache, eng.device)
        eager = eng.model.compute_logits(eng.model(ids, batch)).clone()
        run, how = _forward_runner(llm, ids, batch)
        assert how == "graph"
        torch.testing.assert_close(run(), eager)  # the graph's output buffer after a replay
    eng.abort(req.request_id)
    eng.step()
