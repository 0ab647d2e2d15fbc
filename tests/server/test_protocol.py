import pytest

from lowbit.engine.sampling import model_sampling_defaults
from lowbit.errors import LowbitError
from lowbit.server.protocol import ChatCompletionRequest, CompletionRequest

GEN = {"do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.95, "eos_token_id": [0, 2]}


def test_model_defaults_fill_what_the_request_leaves_out():
    defaults = model_sampling_defaults(GEN)
    assert defaults == {"temperature": 0.8, "top_k": 50, "top_p": 0.95}
    p = CompletionRequest(prompt="x", temperature=0.2).to_params(defaults)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.max_tokens) == (0.2, 50, 0.95, 0.0, 16)
    bare = CompletionRequest(prompt="x").to_params({})
    assert (bare.temperature, bare.top_k, bare.top_p) == (1.0, -1, 1.0)


def test_chat_max_completion_tokens_and_logprobs():
    req = ChatCompletionRequest(messages=[], max_tokens=5, max_completion_tokens=7, logprobs=True, top_logprobs=3)
    p = req.to_params({})
    assert p.max_tokens == 7 and p.logprobs == 3
    assert ChatCompletionRequest(messages=[], logprobs=True).to_params({}).logprobs == 0
    with pytest.raises(LowbitError):
        ChatCompletionRequest(messages=[], top_logprobs=2).to_params({})


def test_echo_asks_for_prompt_logprobs_and_prompt_shapes():
    req = CompletionRequest(prompt=[[1, 2], [3]], echo=True, logprobs=2)
    assert req.to_params({}).prompt_logprobs == 2 and req.prompts() == [[1, 2], [3]]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt="a").to_params({}).prompt_logprobs is None
