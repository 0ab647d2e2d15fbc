"""A tiny OpenAI-compatible streaming server for client tests: deterministic chunk timing,
optional usage and /tokenize, Prometheus counters of what it sent, and a peak in-flight
gauge. Runs uvicorn in a thread on 127.0.0.1 and a free port."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


@dataclass
class FakeState:
    ttft_s: float = 0.02
    itl_s: float = 0.005
    usage: bool = True
    tokenize: bool = True
    accept_text: bool = True  # False: like a server without a tokenizer, text prompts get 400
    fail_every: int = 0  # every n-th request answers 500
    strict_fields: bool = False  # True: like transformers serve, vLLM extensions get 422
    requests: int = 0
    tokens_sent: int = 0
    inflight: int = 0
    peak_inflight: int = 0
    sent_per_request: list[int] = field(default_factory=list)


def build_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(req: Request):
        if not state.tokenize:
            return JSONResponse({"error": "no"}, status_code=404)
        body = await req.json()
        return {"tokens": [sum(map(ord, w)) % 1000 for w in body["prompt"].split()]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# HELP fake_requests_total requests\n"
            f"fake_requests_total {state.requests}\nfake_generated_tokens_total {state.tokens_sent}\n"
            f'fake_peak_inflight{{kind="gauge"}} {state.peak_inflight}\n')

    @app.post("/peak/reset")
    async def reset_peak():
        state.peak_inflight = 0
        return {}

    async def completion(req: Request, chat: bool):
        body = await req.json()
        state.requests += 1
        if state.fail_every and state.requests % state.fail_every == 0:
            return JSONResponse({"error": "injected failure"}, status_code=500)
        if state.strict_fields and "ignore_eos" in body:
            return JSONResponse({"detail": "Unexpected fields in the request: {'ignore_eos'}"},
                                status_code=422)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if isinstance(prompt, str) and not state.accept_text:
            return JSONResponse({"error": {"message": "this model has no tokenizer; send token ids"}},
                                status_code=400)
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        n_out = int(body.get("max_tokens") or 16)
        include_usage = (body.get("stream_options") or {}).get("include_usage") and state.usage

        async def events():
            state.inflight += 1
            state.peak_inflight = max(state.peak_inflight, state.inflight)
            try:
                if chat:  # a role-only first event carries no token
                    yield "data: " + json.dumps({"id": "x", "choices": [
                        {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}) + "\n\n"
                await asyncio.sleep(state.ttft_s)
                for i in range(n_out):
                    if i:
                        await asyncio.sleep(state.itl_s)
                    text = f" t{i}" if state.accept_text else ""  # no tokenizer: ids only, empty text
                    piece = {"delta": {"content": text}} if chat else {"text": text}
                    last = i == n_out - 1
                    yield "data: " + json.dumps({"id": "x", "created": int(time.time()), "choices": [
                        {"index": 0, **piece, "finish_reason": "length" if last else None}]}) + "\n\n"
                    state.tokens_sent += 1
                if include_usage:
                    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                             "total_tokens": n_prompt + n_out}
                    yield "data: " + json.dumps({"id": "x", "choices": [], "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
                state.sent_per_request.append(n_out)
            finally:
                state.inflight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await completion(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        return await completion(req, chat=True)

    return app


class FakeServer:
    def __init__(self, state: FakeState) -> None:
        self.state = state
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        cfg = uvicorn.Config(build_app(state), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started and time.time() < deadline:
            time.sleep(0.01)
        assert self.server.started, "the fake server did not start"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()
