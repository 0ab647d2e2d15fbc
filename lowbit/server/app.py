"""The FastAPI app: OpenAI routes, tokenizer routes, health, metrics, auth, errors.

Every error leaves as the OpenAI envelope {"error": {"message", "type", "param", "code"}}:
a bad request is 400 (never 422) before any model work, a missing or wrong key 401, an
unknown model 404, a body over --max-request-body-bytes 413, a full queue 429 with
Retry-After, and a loading, draining or dead engine 503 (with Retry-After unless dead).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lowbit.config import EngineConfig
from lowbit.engine.async_engine import AsyncLLMEngine, EngineUnavailable, QueueFull
from lowbit.engine.prompt import PromptEncoder
from lowbit.engine.request import RequestRejected
from lowbit.engine.sampling import model_sampling_defaults
from lowbit.errors import LowbitError
from lowbit.server import metrics, serving, startup
from lowbit.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, error_body
from lowbit.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

log = logging.getLogger("lowbit")


class ModelNotFound(LowbitError):
    pass


class ServerState:
    def __init__(self, config: EngineConfig, engine: AsyncLLMEngine) -> None:
        self.config, self.engine = config, engine
        self.model_name = config.served_model_name or config.model
        self.created = int(time.time())
        self._prompts: PromptEncoder | None = None
        self.startup: startup.StartupReport | None = None

    def keep_startup_report(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            log.error("the startup report failed: %s", task.exception())
            return
        self.startup = task.result()

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.config.model):
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves {self.model_name!r}")

    @property
    def tokenizer(self):
        return self.engine.check_available().tokenizer

    @property
    def sampling_defaults(self) -> dict:
        return model_sampling_defaults(self.engine.check_available().loaded.generation_config)

    @property
    def prompts(self) -> PromptEncoder:
        if self._prompts is None:
            if self.tokenizer is None:
                raise LowbitError("this model has no tokenizer; send token ids")
            self._prompts = PromptEncoder(self.tokenizer)
        return self._prompts

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        prompts = self.prompts
        try:
            return prompts.encode_chat(messages, add_generation_prompt)
        except RequestRejected:
            raise
        except LowbitError as e:  # the template refused the messages
            raise RequestRejected(str(e), param="messages") from e

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.prompts.encode(prompt)
        return None, list(prompt)


def _status(e: Exception) -> tuple[int, str, str | None, dict]:
    """(status, type, code, headers) for an exception."""
    if isinstance(e, QueueFull):
        return 429, "rate_limit_exceeded", "rate_limit_exceeded", {"Retry-After": "1"}
    if isinstance(e, EngineUnavailable):
        return 503, "service_unavailable", None, _retry_after(e)
    if isinstance(e, ModelNotFound):
        return 404, "invalid_request_error", "model_not_found", {}
    return 400, "invalid_request_error", getattr(e, "code", None), {}


def _retry_after(e: EngineUnavailable) -> dict:
    return {"Retry-After": str(e.retry_after)} if e.retry_after is not None else {}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LowbitError)
    async def lowbit_error(request: Request, e: LowbitError):
        status, kind, code, headers = _status(e)
        return JSONResponse(error_body(str(e), kind, getattr(e, "param", None), code), status, headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        msg = f"{where}: {err['msg']}" if where else err["msg"]
        # param: the request field (deeper parts of loc can be pydantic's union member names)
        return JSONResponse(error_body(msg, "invalid_request_error", loc[0] if loc else None, None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), "invalid_request_error", None, None), e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {e}", "server_error", None, None), 500)


def create_app(config: EngineConfig, engine: AsyncLLMEngine) -> FastAPI:
    state = ServerState(config, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        report = asyncio.create_task(startup.report_when_ready(engine))
        report.add_done_callback(state.keep_startup_report)
        yield
        report.cancel()
        await engine.shutdown(config.shutdown_timeout)

    app = FastAPI(title="lowbit", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.lowbit = state
    install_error_handlers(app)
    add_info_routes(app, state)
    add_openai_routes(app, state)
    add_tokenizer_routes(app, state)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, open_paths=("/health",))
    return app


def add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        try:
            state.engine.check_available()
        except EngineUnavailable as e:
            return JSONResponse(error_body(str(e), "service_unavailable", None, None), 503, _retry_after(e))
        return PlainTextResponse("")

    @app.get("/v1/models")
    async def models():
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "lowbit",
                "root": state.config.model}
        if state.engine.engine is not None:
            card["max_model_len"] = state.engine.engine.max_model_len
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics_route():
        return PlainTextResponse(metrics.render(state.engine.engine, state.model_name, state.startup),
                                 media_type="text/plain; version=0.0.4")


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        state.check_model(body.model)
        body.warn_unknown()
        params = body.to_params(state.sampling_defaults)
        prompts = [state.encode_prompt(p) for p in body.prompts()]
        sub = serving.Submission(state.engine, "cmpl", prompts, params)
        tok = state.tokenizer
        if body.stream:
            return serving.streaming_response(
                serving.completion_stream(sub, state.model_name, body.echo, body.include_usage, tok))
        if not await sub.collect(request):
            return serving.client_gone()
        return serving.completion_body(sub, state.model_name, body.echo, tok)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        state.check_model(body.model)
        body.warn_unknown()
        params = body.to_params(state.sampling_defaults)
        ids = state.encode_chat(body.messages, body.add_generation_prompt)
        sub = serving.Submission(state.engine, "chatcmpl", [(None, ids)], params)
        if body.stream:
            return serving.streaming_response(
                serving.chat_stream(sub, state.model_name, body.include_usage, state.tokenizer))
        if not await sub.collect(request):
            return serving.client_gone()
        return serving.chat_body(sub, state.model_name, state.tokenizer)


def add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestRejected("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            ids = state.encode_chat(body.messages, body.add_generation_prompt)
        else:
            ids = state.prompts.encode(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": state.engine.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        vocab = state.engine.check_available().arch.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        return {"prompt": state.prompts.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = state.prompts.tokenizer
        return {"tokenizer_class": "PreTrainedTokenizerFast", "vocab_size": tok.vocab_size,
                "bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template,
                "model_max_length": state.engine.engine.max_model_len,
                "added_tokens": {str(i): t.content for i, t in tok.tok.get_added_tokens_decoder().items()}}
