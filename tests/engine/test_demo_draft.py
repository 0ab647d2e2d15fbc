"""The built-in `demo-draft` model (scripts/demo/train_draft.py): a 2-layer draft of the demo
model that speculative decoding accepts often, without changing greedy output."""

import json

import pytest

from lowbit import LLM, SamplingParams
from lowbit.checkpoint.hf import resolve_model_dir

DEMO, DRAFT = resolve_model_dir("demo"), resolve_model_dir("demo-draft")
PROMPTS = ["It is a truth universally acknowledged", "In the beginning", "HAMLET.\nTo be, or not to be",
           "Mr. Darcy"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def test_the_draft_shares_the_demo_tokenizer_and_width():
    demo, draft = (json.loads((d / "config.json").read_text()) for d in (DEMO, DRAFT))
    assert draft["num_hidden_layers"] < demo["num_hidden_layers"]
    for key in ("vocab_size", "hidden_size", "model_type", "eos_token_id"):
        assert draft[key] == demo[key], key
    assert (DRAFT / "tokenizer.json").read_bytes() == (DEMO / "tokenizer.json").read_bytes()


@pytest.fixture(scope="module")
def demo():
    return LLM("demo", kv_cache_tokens=4096, max_num_batched_tokens=64, max_num_seqs=16)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_the_same_and_most_drafts_are_accepted(demo, k):
    spec = LLM("demo", kv_cache_tokens=4096, max_num_batched_tokens=64, max_num_seqs=16,
               speculative_method="draft", speculative_model="demo-draft", num_speculative_tokens=k,
               loaded=demo.loaded)
    want = [o.outputs[0].token_ids for o in demo.generate(PROMPTS, GREEDY)]
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, GREEDY)]
    assert got == want
    stats = spec.engine.spec.stats
    assert stats.num_drafts > 0 and stats.num_accepted < stats.num_drafts
    # Trained by distillation to agree with the demo model's greedy choice (held-out top-1
    # agreement 0.55; 0.26 for the copied layers before training, record.json): on these
    # prompts about 0.6 of first drafts are accepted (docs/SERVING.md)
    assert stats.accept_rate_per_position[0] > 0.5
    if k == 3:
        assert stats.mean_accepted_length > 1.8
