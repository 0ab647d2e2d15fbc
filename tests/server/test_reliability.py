import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

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

# (route, body, code or None, param): every one must be answered 400 with the OpenAI
# envelope, its `param` naming the request field at fault
BAD_REQUESTS = [
    ("completions", {"prompt": LONG}, "context_length_exceeded", "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, "context_length_exceeded", "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 10**9}, "context_length_exceeded", "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, None, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": -5}, None, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, None, "max_completion_tokens"),
    ("completions", {"prompt": "hi", "temperature": -1}, None, "temperature"),
    ("completions", {"prompt": "hi", "temperature": float("nan")}, None, "temperature"),
    ("completions", {"prompt": "hi", "temperature": float("inf")}, None, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, None, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, None, "top_p"),
    ("completions", {"prompt": "hi", "top_k": -2}, None, "top_k"),
    ("completions", {"prompt": "hi", "min_p": 2}, None, "min_p"),
    ("completions", {"prompt": "hi", "n": 1000}, None, "n"),
    ("completions", {"prompt": "hi", "logprobs": 21}, None, "logprobs"),
    ("completions", {"prompt": "hi", "echo": True, "logprobs": 21}, None, "logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, None, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, None, "top_logprobs"),
    ("completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(40)]}, None, "stop"),
    ("completions", {"prompt": [1, 100000]}, None, "prompt"),
    ("completions", {"prompt": [-1, 2]}, None, "prompt"),
    ("completions", {"prompt": ""}, None, "prompt"),
    ("completions", {"prompt": []}, None, "prompt"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, None, "temperature"),
    ("completions", {"prompt": {"text": "hi"}}, None, "prompt"),
    ("chat/completions", {"messages": "hi"}, None, "messages"),
    ("chat/completions", {"messages": []}, None, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, "messages"),
    ("completions", {"prompt": "hi", "stop_token_ids": [10**6]}, None, "stop_token_ids"),
    ("completions", {"prompt": "hi", "presence_penalty": 5}, None, "presence_penalty"),
    ("completions", {"prompt": "hi", "frequency_penalty": -3}, None, "frequency_penalty"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, None, "repetition_penalty"),
    ("completions", {"prompt": "hi", "seed": "abc"}, None, "seed"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, None, "stream_options"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 10}}, None, "logit_bias"),
    ("completions", {"prompt": "hi", "suffix": "end"}, None, "suffix"),
    ("completions", {"max_tokens": 3}, None, "prompt"),
    # wrong JSON types are refused, never coerced
    ("completions", {"prompt": "hi", "n": True}, None, "n"),
    ("completions", {"prompt": "hi", "temperature": "0"}, None, "temperature"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, None, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 5.0}, None, "max_tokens"),
    ("completions", {"prompt": "hi", "stream": "yes"}, None, "stream"),
    ("completions", {"prompt": "hi", "echo": 1}, None, "echo"),
    ("completions", {"prompt": "hi", "logprobs": True}, None, "logprobs"),
    ("completions", {"prompt": "hi", "seed": 1.5}, None, "seed"),
    ("completions", {"prompt": "hi", "stop": 5}, None, "stop"),
    ("chat/completions", {"messages": CHAT, "logprobs": 1}, None, "logprobs"),
    ("chat/completions", {"messages": CHAT, "stream": True, "stream_options": {"include_usage": "yes"}}, None,
     "stream_options"),
]


def assert_envelope(r: httpx.Response, status: int, code=None, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("route,body,code,param", BAD_REQUESTS)
def test_bad_input_is_400_and_the_server_stays_healthy(server, route, body, code, param):
    with server.http() as h:
        r = h.post(f"/v1/{route}", content=json.dumps({"model": MODEL, **body}),
                   headers={"content-type": "application/json"})
        assert assert_envelope(r, 400, code, param)["type"] == "invalid_request_error"
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


def test_metrics_show_every_kv_block_free_after_disconnects(server):
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    for _ in range(4):
        with server.http() as h, h.stream("POST", "/v1/completions", json=body) as r:
            assert next(r.iter_lines()).startswith("data: ")  # blocks are taken; now hang up
    with server.http(timeout=httpx.Timeout(60, read=0.3)) as h, pytest.raises(httpx.ReadTimeout):
        h.post("/v1/completions", json={**body, "stream": False})

    def idle() -> bool:
        _, m = server.metrics()
        busy = m["vllm:num_requests_running"][0][1] + m["vllm:num_requests_waiting"][0][1]
        return busy == 0 and m["lowbit:kv_cache_free_blocks"][0][1] == m["lowbit:kv_cache_blocks"][0][1]

    wait_for(idle, what="/metrics to show no request and every KV block free")
    _, m = server.metrics()
    assert m["lowbit:kv_cache_blocks"][0][1] == server.engine.blocks.num_total_blocks > 0
    assert m["vllm:kv_cache_usage_perc"][0][1] == 0


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
            for r in (h.get("/health"), h.post("/v1/completions", json={"prompt": "hi"})):
                assert_envelope(r, 503)
                assert r.headers["retry-after"] == "5"  # loading: worth a retry
            gate.set()
            wait_for(lambda: engine.error is not None, what="the engine to fail")
            for r in (h.get("/health"), h.post("/v1/completions", json={"prompt": "hi"})):
                assert_envelope(r, 503)
                assert "retry-after" not in r.headers  # dead: a retry cannot succeed
    finally:
        gate.set()
        srv.should_exit = True
        t.join(30)


@pytest.fixture
def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_drain_answers_503_and_aborts_what_outlives_the_timeout(start_server):
    s = start_server(shutdown_timeout=2.0)
    step = s.engine.step

    def slow_step():
        time.sleep(0.02)  # 250 tokens now take over 5 s: they outlive the 2 s drain
        return step()

    s.engine.step = slow_step
    body = {"model": MODEL, "prompt": "x", "max_tokens": 250, "ignore_eos": True}
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    whole = {}

    def chat_events(h: httpx.Client) -> None:
        with h.stream("POST", "/v1/chat/completions", json=chat) as r:
            whole["chat"] = [ln for ln in r.iter_lines() if ln.startswith("data: ")]

    with s.http() as h1, s.http() as h2, s.http() as h3, s.http() as h4:
        waiters = [threading.Thread(target=lambda: whole.update(r=h2.post("/v1/completions", json=body))),
                   threading.Thread(target=chat_events, args=(h4,))]
        with h1.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            for w in waiters:
                w.start()
            wait_for(lambda: s.engine.num_running == 3, what="the three requests to run")
            s.server.handle_exit(signal.SIGTERM, None)  # what the signal handler runs
            for refused in (h3.post("/v1/completions", json=body), h3.get("/health")):
                assert_envelope(refused, 503)
                assert refused.headers["retry-after"] == "1"
            rest = [json.loads(ln[6:]) if ln != "data: [DONE]" else ln for ln in lines if ln.startswith("data: ")]
        for w in waiters:
            w.join(30)
    assert rest[-1] == "data: [DONE]"
    assert rest[-2]["choices"][0]["finish_reason"] == "abort"
    assert all(ev["choices"][0]["finish_reason"] is None for ev in rest[:-2])
    assert whole["r"].status_code == 200
    choice = whole["r"].json()["choices"][0]
    assert choice["finish_reason"] == "abort" and whole["r"].json()["usage"]["completion_tokens"] < 250
    assert whole["chat"][-1] == "data: [DONE]"
    assert json.loads(whole["chat"][-2][6:])["choices"][0]["finish_reason"] == "abort"
    s.thread.join(30)
    assert not s.thread.is_alive()
    assert s.engine.blocks.num_free_blocks == s.engine.blocks.num_total_blocks


def serve(tiny_model, port: int, *flags: str) -> tuple[subprocess.Popen, str]:
    """`lowbit serve` in a subprocess; (process, base URL) once /health answers 200."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowbit", "serve", str(tiny_model), "--port", str(port),
         "--kv-cache-tokens", "1024", *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, proc.stdout.read()
        try:
            return httpx.get(base + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(healthy, timeout=120, what="the server to come up")
    except BaseException:
        proc.kill()
        raise
    return proc, base


def stream_through_sigterm(proc: subprocess.Popen, base: str, body: dict) -> list:
    """Start a stream, send SIGTERM after its first chunk; the events that followed."""
    with httpx.Client(base_url=base, timeout=60) as h, h.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        proc.send_signal(signal.SIGTERM)
        return [json.loads(ln[6:]) if ln != "data: [DONE]" else ln for ln in lines if ln.startswith("data: ")]


def test_sigterm_finishes_in_flight_requests_and_exits_0(tiny_model, unused_port):
    proc, base = serve(tiny_model, unused_port, "--shutdown-timeout", "20")
    try:
        metrics = httpx.get(base + "/metrics").text
        rest = stream_through_sigterm(proc, base, {"prompt": "x", "max_tokens": 40, "ignore_eos": True,
                                                   "stream": True})
        assert rest[-1] == "data: [DONE]"
        assert rest[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
        output = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "KV cache:" in output and "tokens" in output
    report = re.search(r"ready in ([0-9.]+) s; peak memory ([0-9.]+) MiB \(process peak RSS, cpu\)", output)
    assert report and 0 < float(report[1]) < 120 and float(report[2]) > 1
    startup = re.search(r'^lowbit:startup_seconds\{model_name="[^"]*"\} ([0-9.]+)$', metrics, re.M)
    assert startup and float(startup[1]) == pytest.approx(float(report[1]), abs=0.06)
    assert re.search(r'^lowbit:peak_memory_bytes\{.*device="cpu",measure="peak_rss"\} [1-9]', metrics, re.M)
    assert re.search(r'^lowbit:kv_cache_tokens\{.*\} 1024$', metrics, re.M)


def test_sigterm_aborts_streams_that_outlive_the_timeout_and_exits_0(tiny_model, unused_port):
    proc, base = serve(tiny_model, unused_port, "--shutdown-timeout", "0")
    try:
        rest = stream_through_sigterm(proc, base, {"prompt": "x", "max_tokens": 250, "ignore_eos": True,
                                                   "stream": True})
        assert rest[-1] == "data: [DONE]"
        assert rest[-2]["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_engine_thread_freezes_the_heap_once_the_engine_is_built():
    """Objects that live as long as the server (the model, routes, tokenizer) leave the
    collector's reach once the engine is built, so a full collection while serving does not
    walk them; the freeze comes after the engine exists, so the engine is among them."""
    import gc

    seen = {}

    class Probe:
        def has_unfinished(self):
            return False

    def factory():
        gc.unfreeze()  # whatever an earlier server froze
        seen["probe"] = Probe()
        return seen["probe"]

    engine = AsyncLLMEngine(factory, max_queued_requests=1)
    try:
        engine.start()
        wait_for(lambda: engine.is_ready and gc.get_freeze_count() > 0, what="the frozen heap")
        assert engine.engine is seen["probe"]
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the interpreter's and the test session's objects, the probe among them
    finally:
        gc.unfreeze()  # the daemon engine thread waits for commands; the test session's heap is its own again
