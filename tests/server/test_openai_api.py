import importlib.util
import json

import pytest

from lowbit.bench.client import parse_prometheus

MODEL = "tiny"


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_models_and_health(server):
    with server.http() as h:
        assert h.get("/health").status_code == 200
        models = h.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 256
    assert [m.id for m in server.client().models.list()] == [MODEL]


@pytest.mark.parametrize("prompt,count", [("Hello", 1), (["ab", "cd"], 2), ([72, 105], 1), ([[72], [105, 33]], 2)])
def test_completion_prompt_shapes(server, prompt, count):
    r = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert len(r.choices) == count and [c.index for c in r.choices] == list(range(count))
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 3 * count


def test_stream_concatenates_to_the_non_streamed_completion(server):
    c = server.client()
    args = dict(model=MODEL, prompt="The quick brown", max_tokens=12, temperature=0.9, seed=11,
                extra_body={"ignore_eos": True})
    whole = c.completions.create(**args).choices[0]
    chunks = list(c.completions.create(stream=True, **args))
    assert "".join(ch.choices[0].text for ch in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "length"


def test_stream_with_a_stop_string_matches_too(server):
    c = server.client()
    free = c.completions.create(model=MODEL, prompt="abc", max_tokens=16, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = free[6:9]
    args = dict(model=MODEL, prompt="abc", max_tokens=16, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    whole = c.completions.create(**args).choices[0]
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **args))
    assert whole.text == streamed == free[:free.find(stop)] and whole.finish_reason == "stop"


def test_echo_with_logprobs_starts_with_a_null(server):
    r = server.client().completions.create(model=MODEL, prompt="Hi there", max_tokens=2, temperature=0,
                                           echo=True, logprobs=2, extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.text.startswith("Hi there")
    lp = ch.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == 8 + 2 and all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == ch.text


def test_n_choices(server):
    r = server.client().completions.create(model=MODEL, prompt="x", n=3, max_tokens=6, temperature=1.0, seed=5,
                                           extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1


def test_chat_stream_role_first_finish_last_usage_then_done(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with server.http() as h, h.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage, chunks = events[-2], events[:-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    whole = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == usage["usage"]["prompt_tokens"]


def test_chat_logprobs(server):
    r = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_tokenize_detokenize_and_tokenizer_info(server):
    with server.http() as h:
        tok = h.post("/tokenize", json={"prompt": "hey <|im_end|>"}).json()
        assert tok["count"] == len(tok["tokens"]) == 5 and tok["max_model_len"] == 256
        assert h.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "hey <|im_end|>"
        chat = h.post("/tokenize", json={"messages": [{"role": "user", "content": "<|im_start|>"}]}).json()
        im_start = tok["tokens"][-1] - 1
        assert chat["tokens"].count(im_start) == 2  # the template's two, not the user's text
        info = h.get("/tokenizer_info").json()
        assert info["eos_token"] == "<|endoftext|>" and "im_start" in info["chat_template"]


VLLM_SERIES = {"num_requests_running": "gauge", "num_requests_waiting": "gauge", "kv_cache_usage_perc": "gauge",
               "prompt_tokens_total": "counter", "generation_tokens_total": "counter",
               "num_preemptions_total": "counter", "prefix_cache_queries_total": "counter",
               "prefix_cache_hits_total": "counter", "request_success_total": "counter",
               "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
               "e2e_request_latency_seconds": "histogram"}
LOWBIT_SERIES = {"kv_cache_free_blocks": "gauge", "kv_cache_blocks": "gauge", "kv_cache_tokens": "gauge",
                 "startup_seconds": "gauge", "peak_memory_bytes": "gauge"}


def test_metrics_use_vllm_names_types_and_prefix(server):
    server.client().completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0)
    types, samples = server.metrics()
    for name, kind in VLLM_SERIES.items():
        assert types.get(f"vllm:{name}") == kind, name
        assert f"lowbit:{name}" not in types
    for name, kind in LOWBIT_SERIES.items():
        assert types.get(f"lowbit:{name}") == kind, name
    series, generated = samples["vllm:generation_tokens_total"][0]
    assert generated >= 3 and 'model_name="tiny"' in series
    assert samples["vllm:time_to_first_token_seconds_count"][0][1] >= 1
    assert samples["vllm:inter_token_latency_seconds_count"][0][1] >= 2
    assert any('finished_reason="length"' in s for s, _ in samples["vllm:request_success_total"])
    assert samples["lowbit:kv_cache_tokens"][0][1] == 4096 and samples["lowbit:kv_cache_blocks"][0][1] == 4096 / 16
    assert samples["lowbit:startup_seconds"][0][1] > 0
    series, peak = samples["lowbit:peak_memory_bytes"][0]
    assert peak > 2**20 and 'device="cpu",measure="peak_rss"' in series
    with server.http() as h:  # what `lowbit bench serve` reads
        parsed = parse_prometheus(h.get("/metrics").text)
    assert any(k.startswith("vllm:generation_tokens_total{") for k in parsed)
    if importlib.util.find_spec("lowbit.kernels.routes") is not None:
        assert any(s.startswith('lowbit:route_calls_total{model_name="tiny",op="linear"')
                   for s, _ in samples["lowbit:route_calls_total"])


@pytest.mark.parametrize("echo", [True, False])
def test_streamed_logprobs_match_the_non_streamed_ones(server, echo):
    c = server.client()
    args = dict(model=MODEL, prompt="Hi there", max_tokens=6, temperature=0, echo=echo, logprobs=2,
                extra_body={"ignore_eos": True})
    whole = c.completions.create(**args).choices[0]
    chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **args)]
    if echo:
        lp = chunks[0].logprobs
        assert chunks[0].text == "Hi there" and len(lp.tokens) == 8
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[:2] == [0, 1]
    assert "".join(ch.text for ch in chunks) == whole.text
    merged = {k: sum((getattr(ch.logprobs, k) for ch in chunks if ch.logprobs), [])
              for k in ("tokens", "text_offset", "token_logprobs")}
    assert merged["tokens"] == whole.logprobs.tokens
    assert merged["text_offset"] == whole.logprobs.text_offset
    assert merged["token_logprobs"] == pytest.approx(whole.logprobs.token_logprobs, abs=1e-4)


def test_graph_gauges_count_the_graphs_held_and_the_start_up_capture():
    """lowbit:cuda_graphs counts each holder's graphs now (a count that grows between two
    scrapes: a request waited for a capture); graph_capture_seconds is the start-up capture's
    time, which `bench serve` keeps in its start-up line."""
    from types import SimpleNamespace

    from lowbit.bench.client import parse_prometheus
    from lowbit.bench.serve import server_startup, startup_line
    from lowbit.server.metrics import Exposition, _graph_metrics

    runner = SimpleNamespace(graphs=SimpleNamespace(graphs={(1, None): 0, (2, None): 0}),
                             prefill_graphs=SimpleNamespace(graphs={(16, 1, None): 0}))
    out = Exposition("m", "lowbit")
    _graph_metrics(out, SimpleNamespace(runner=runner, startup_capture={"seconds": 3.214}))
    parsed = parse_prometheus("\n".join(out.lines) + "\n")
    assert parsed['lowbit:cuda_graphs{model_name="m",kind="decode"}'] == 2
    assert parsed['lowbit:cuda_graphs{model_name="m",kind="prefill"}'] == 1
    assert parsed['lowbit:graph_capture_seconds{model_name="m"}'] == 3.214
    up = server_startup({'lowbit:graph_capture_seconds{model_name="m"}': 3.214, "lowbit:startup_seconds": 20.0})
    assert "captured at start in 3.2 s" in startup_line({"server_startup": up})
    out = Exposition("m", "lowbit")
    _graph_metrics(out, SimpleNamespace(runner=SimpleNamespace(graphs=None, prefill_graphs=None),
                                        startup_capture=None))
    assert out.lines == []  # the CPU: no graphs, no series
