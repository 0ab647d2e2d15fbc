"""`lowbit serve demo` through the openai client."""

from pathlib import Path

import pytest

import lowbit
from lowbit.config import EngineConfig
from tests.server.conftest import SERVER_DEFAULTS, RunningServer

DEMO = Path(lowbit.__file__).parent / "demo_model"
pytestmark = pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="the demo model is not installed")


@pytest.fixture(scope="module")
def demo_server():
    s = RunningServer(EngineConfig(model="demo", **{**SERVER_DEFAULTS, "served_model_name": "demo"}))
    yield s
    s.stop()


def test_demo_chat_streams_what_it_answers(demo_server):
    c = demo_server.client()
    args = dict(model="demo", messages=[{"role": "user", "content": "Who is Mr. Darcy?"}], max_tokens=24,
                temperature=0.8, seed=3)
    whole = c.chat.completions.create(**args).choices[0]
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **args))
    assert streamed == whole.message.content and len(whole.message.content.split()) >= 3


def test_demo_completion_batch_of_prompts(demo_server):
    r = demo_server.client().completions.create(model="demo", prompt=["In the beginning", "Mr. Darcy"],
                                                max_tokens=12, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and all(c.text for c in r.choices)
    demo_server.wait_idle()
