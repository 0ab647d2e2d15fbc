import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from lowbit.config import EngineConfig
from lowbit.engine.async_engine import AsyncLLMEngine
from lowbit.server.app import create_app
from tests.server.conftest import wait_for

MODEL = "tiny"
CHAT = [{"role": "user", "content": "hi"}]
LONG = [5] * 300  # over the 256-token context

# (route, body, code or None): every one must be answered 400 with the OpenAI envelope
BAD_REQUESTS = [
    ("completions", {"prompt": LONG}, "context_length_exceeded"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, "context_length_exceeded"),
    ("completions", {"prompt": "hi", "max_tokens": 10**9}, "context_length_exceeded"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, None),
    ("completions", {"prompt": "hi", "max_tokens": -5}, None),
    ("completions", {"prompt": "hi", "temperature": -1}, None),
    ("completions", {"prompt": "hi", "temperature": float("nan")}, None),
    ("completions", {"prompt": "hi", "temperature": float("inf")}, None),
    ("completions", {"prompt": "hi", "top_p": 0}, None),
    ("completions", {"prompt": "hi", "top_p": 1.5}, None),
    ("completions", {"prompt": "hi", "top_k": -2}, None),
    ("completions", {"prompt": "hi", "n": 1000}, None),
    ("completions", {"prompt": "hi", "logprobs": 21}, None),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, None),
    ("completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(40)]}, None),
    ("completions", {"prompt": [1, 100000]}, None),
    ("completions", {"prompt": [-1, 2]}, None),
    ("completions", {"prompt": ""}, None),
    ("completions", {"prompt": []}, None),
    ("completions", {"prompt": "hi", "temperature": "hot"}, None),
    ("completions", {"prompt": {"text": "hi"}}, None),
    ("chat/completions", {"messages": "hi"}, None),
    ("chat/completions", {"messages": []}, None),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None),
    ("completions", {"prompt": "hi", "stop_token_ids": [10**6]}, None),
    ("completions", {"prompt": "hi", "presence_penalty": 5}, None),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, None),
    ("completions", {"prompt": "hi", "seed": "abc"}, None),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, None),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 10}}, None),
    ("completions", {"max_tokens": 3}, None),
]


def assert_envelope(r: httpx.Response, status: int, code=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize("route,body,code", BAD_REQUESTS)
def test_bad_input_is_400_and_the_server_stays_healthy(server, route, body, code):
    with server.http() as h:
        r = h.post(f"/v1/{route}", content=json.dumps({"model": MODEL, **body}),
                   headers={"content-type": "application/json"})
        assert_envelope(r, 400, code)
        assert h.get("/health").status_code == 200
    assert not server.engine.has_unfinished()


def test_malformed_json_is_400(server):
    with server.http() as h:
        r = h.post("/v1/completions", content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"})
        assert_envelope(r, 400)
        assert h.get("/health").status_code == 200


def test_openai_client_sees_bad_request_errors(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt=LONG, max_tokens=2)
    assert e.value.code == "context_length_exceeded"


def test_unknown_model_404_oversized_body_413(server):
    with server.http() as h:
        assert_envelope(h.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404, "model_not_found")
        big = {"model": MODEL, "prompt": "x" * (2 << 20)}
        assert_envelope(h.post("/v1/completions", json=big), 413, "request_too_large")
        assert h.get("/health").status_code == 200


def test_unknown_fields_are_accepted_with_a_warning(server, caplog):
    with caplog.at_level(logging.WARNING, logger="lowbit"), server.http() as h:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "frobnicate": 1})
    assert r.status_code == 200
    assert any("frobnicate" in rec.getMessage() for rec in caplog.records)


def test_request_that_can_never_fit_the_pool(start_server):
    s = start_server(kv_cache_tokens=128)
    with s.http() as h:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": [3] * 100, "max_tokens": 100})
        assert_envelope(r, 400, "kv_cache_too_small")


def test_disconnects_mid_stream_free_every_block(server):
    aborted = server.engine.stats.request_success_total.get("abort", 0)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    for _ in range(12):
        with server.http() as h, h.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # generation is under way; now hang up
    with server.http(timeout=httpx.Timeout(60, read=0.3)) as h:  # a non-streaming client that gives up
        with pytest.raises(httpx.ReadTimeout):
            h.post("/v1/completions", json={**body, "stream": False, "max_tokens": 240})
    server.wait_idle()
    assert server.engine.stats.request_success_total.get("abort", 0) - aborted == 13


def test_overload_answers_429_with_retry_after(start_server):
    s = start_server(max_num_seqs=1, max_queued_requests=1)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with s.http() as h1, s.http() as h2, s.http() as h3:
        with h1.stream("POST", "/v1/chat/completions", json=body) as a, \
                h2.stream("POST", "/v1/chat/completions", json=body) as b:
            lines_a, lines_b = a.iter_lines(), b.iter_lines()  # dropping an iterator hangs up
            next(lines_a)  # both are admitted: one runs, one waits
            next(lines_b)
            r = h3.post("/v1/chat/completions", json={**body, "stream": False})
            assert_envelope(r, 429)
            assert r.headers["retry-after"] == "1"
    s.wait_idle()


def test_api_key_guards_everything_but_health(start_server):
    s = start_server(api_key="sekret")
    with httpx.Client(base_url=s.base_url) as h:
        assert h.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/tokenizer_info"):
            assert_envelope(h.get(path), 401)
        assert_envelope(h.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}), 401)
    assert s.client().models.list().data[0].id == MODEL
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=s.base_url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_health_is_503_while_loading_and_after_the_engine_dies(unused_port):
    gate = threading.Event()

    def slow_broken_factory():
        gate.wait(30)
        raise RuntimeError("weights on fire")

    cfg = EngineConfig(model="tiny", host="127.0.0.1", port=unused_port)
    engine = AsyncLLMEngine(slow_broken_factory, max_queued_requests=1)
    import uvicorn

    from lowbit.server.launch import uvicorn_config

    srv = uvicorn.Server(uvicorn_config(create_app(cfg, engine), cfg))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: srv.started, what="uvicorn")
        with httpx.Client(base_url=f"http://127.0.0.1:{unused_port}") as h:
            assert_envelope(h.get("/health"), 503)
            assert_envelope(h.post("/v1/completions", json={"prompt": "hi"}), 503)
            gate.set()
            wait_for(lambda: engine.error is not None, what="the engine to fail")
            assert_envelope(h.get("/health"), 503)
            assert_envelope(h.post("/v1/completions", json={"prompt": "hi"}), 503)
    finally:
        gate.set()
        srv.should_exit = True
        t.join(30)


@pytest.fixture
def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_in_flight_requests_and_exits_0(tiny_model, unused_port):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowbit", "serve", str(tiny_model), "--port", str(unused_port),
         "--kv-cache-tokens", "1024", "--shutdown-timeout", "20"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{unused_port}"
    try:
        def healthy() -> bool:
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(base + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, timeout=120, what="the server to come up")
        body = {"prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=base, timeout=60) as h, h.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = [ln for ln in lines if ln.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
        output = proc.stdout.read()
        assert "KV cache:" in output and "tokens" in output
    finally:
        if proc.poll() is None:
            proc.kill()
