"""The built-in `demo` model through the engine: real text, the same in any batch."""

from pathlib import Path

import pytest

import lowbit
from lowbit import LLM, SamplingParams

DEMO = Path(lowbit.__file__).parent / "demo_model"
pytestmark = pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="the demo model is not installed")

PROMPTS = ["It is a truth universally acknowledged", "In the beginning", "HAMLET.\nTo be, or not to be"]


@pytest.fixture(scope="module")
def demo():
    return LLM("demo", kv_cache_tokens=4096, max_num_batched_tokens=64)


def test_demo_writes_words(demo):
    out = demo.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    words = out.text.split()
    assert len(words) >= 3 and sum(w.strip(".,;:!?'\"").isalpha() for w in words) >= len(words) // 2


def test_demo_greedy_is_the_same_alone_and_batched(demo):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [demo.generate(p, sp)[0].outputs[0].token_ids for p in PROMPTS]
    together = [o.outputs[0].token_ids for o in demo.generate(PROMPTS, sp)]
    assert together == alone


def test_demo_chat_and_prefix_cache(demo):
    sp = SamplingParams(temperature=0, max_tokens=8)
    messages = [{"role": "user", "content": "Tell me of the king."}]
    first = demo.chat(messages, sp)
    hits = demo.engine.blocks.num_prefix_hits
    again = demo.chat(messages, sp)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert demo.engine.blocks.num_prefix_hits > hits
    assert demo.engine.blocks.num_free_blocks == demo.engine.blocks.num_total_blocks
