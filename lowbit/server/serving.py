"""/v1/completions and /v1/chat/completions: requests in, OpenAI responses or SSE out.

Each prompt times `n` becomes one engine request ("choice"), submitted all or none. A
non-streaming response waits for every choice, and a client that disconnects meanwhile
aborts them. A streaming response sends each choice's deltas as they come; a
disconnect cancels the generator and its `finally` aborts what is still running.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from lowbit.engine.async_engine import AsyncLLMEngine, RequestStream
from lowbit.engine.llm import child_params
from lowbit.engine.request import RequestDelta, TokenLogprob
from lowbit.engine.sampling import SamplingParams
from lowbit.errors import LowbitError
from lowbit.server.logprobs import chat_logprobs, completion_logprobs, end_offset


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    prompt_text: str | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0

    def add(self, d: RequestDelta) -> None:
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.finish_reason = d.finish_reason
        self.num_cached_tokens = d.num_cached_tokens
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs


def usage(choices: list[Choice], prompts: list[list[int]]) -> dict:
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.num_cached_tokens for c in choices)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Submission:
    """The choices of one HTTP request and their engine streams."""

    def __init__(self, engine: AsyncLLMEngine, kind: str, prompts: list[tuple[str | None, list[int]]],
                 params: SamplingParams) -> None:
        self.id = f"{kind}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompt_ids = [ids for _, ids in prompts]
        self.params = params
        self.choices: list[Choice] = []
        reqs = []
        for p, (text, ids) in enumerate(prompts):
            for j in range(params.n):
                index = p * params.n + j
                self.choices.append(Choice(index, ids, text))
                reqs.append((f"{self.id}-{index}", ids, child_params(params, j), text))
        self.streams = engine.submit(reqs)

    def close(self) -> None:
        for s in self.streams:
            s.close()

    async def deltas(self) -> AsyncIterator[tuple[Choice, RequestDelta]]:
        """Every choice's deltas, merged in arrival order."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice, stream: RequestStream) -> None:
            try:
                async for d in stream:
                    await q.put((choice, d))
            except Exception as e:  # noqa: BLE001 - handed to the consumer below
                await q.put(e)
            await q.put(None)

        tasks = [asyncio.create_task(pump(c, s)) for c, s in zip(self.choices, self.streams)]
        try:
            for _ in range(len(tasks)):
                while (item := await q.get()) is not None:
                    if isinstance(item, Exception):
                        raise item
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    async def collect(self, request: Request) -> bool:
        """Wait for every choice to finish; abort them all if the client goes away (False)."""
        async def gather() -> None:
            async for choice, d in self.deltas():
                choice.add(d)

        work = asyncio.create_task(gather())
        gone = asyncio.create_task(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                return False
            work.result()
            return True
        finally:
            gone.cancel()
            self.close()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def client_gone() -> Response:
    """The answer to a client that hung up: nobody reads it (499, as nginx logs it)."""
    return Response(status_code=499)


def streaming_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- /v1/completions ------------------------------------------------------------------------------
def completion_body(sub: Submission, model: str, echo: bool, tokenizer) -> dict:
    choices = []
    for c in sub.choices:
        text = (c.prompt_text or _decode(tokenizer, c.prompt_ids)) + c.text if echo else c.text
        lp = None
        if c.logprobs or c.prompt_logprobs:
            lp = completion_logprobs(tokenizer, (c.prompt_logprobs or []) if echo else [], c.logprobs,
                                     c.prompt_ids if echo else [])
        choices.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
    return {"id": sub.id, "object": "text_completion", "created": sub.created, "model": model,
            "choices": choices, "usage": usage(sub.choices, sub.prompt_ids)}


async def sse_stream(sub: Submission, head: dict, include_usage: bool,
                     chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The frame every stream shares: the chunks, the usage-only chunk when asked, [DONE];
    an engine error becomes an error event; the submission is closed (aborted) however
    the stream ends, a client disconnect included."""
    try:
        async for chunk in chunks:
            yield chunk
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(sub.choices, sub.prompt_ids)})
        yield "data: [DONE]\n\n"
    except LowbitError as e:
        yield stream_error(e)
    finally:
        sub.close()


def completion_stream(sub: Submission, model: str, echo: bool, include_usage: bool,
                      tokenizer) -> AsyncIterator[str]:
    """With echo, each choice starts with its prompt; with echo and logprobs, that chunk
    waits for the first delta, which brings the prompt logprobs. `text_offset` counts over
    the whole choice text, echoed prompt included, as in the non-streamed response."""
    head = {"id": sub.id, "object": "text_completion", "created": sub.created, "model": model}
    chunk = lambda c, text, lp, finish=None: sse(
        {**head, "choices": [{"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish}]})
    offsets = {c.index: 0 for c in sub.choices}
    unechoed = {c.index for c in sub.choices} if echo else set()

    def echo_chunk(c: Choice) -> str:
        unechoed.discard(c.index)
        lp = None
        if c.prompt_logprobs is not None:
            lp = completion_logprobs(tokenizer, c.prompt_logprobs, [], c.prompt_ids)
            offsets[c.index] = end_offset(lp, 0)
        return chunk(c, c.prompt_text or _decode(tokenizer, c.prompt_ids), lp)

    async def chunks() -> AsyncIterator[str]:
        if sub.params.prompt_logprobs is None:
            for c in sub.choices if echo else []:
                yield echo_chunk(c)
        async for c, d in sub.deltas():
            c.add(d)
            if c.index in unechoed:
                yield echo_chunk(c)
            lp = None
            if d.logprobs:
                lp = completion_logprobs(tokenizer, [], d.logprobs, [], offsets[c.index])
                offsets[c.index] = end_offset(lp, offsets[c.index])
            yield chunk(c, d.text, lp, d.finish_reason)

    return sse_stream(sub, head, include_usage, chunks())


# -- /v1/chat/completions -------------------------------------------------------------------------
def chat_body(sub: Submission, model: str, tokenizer) -> dict:
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(tokenizer, c.logprobs) if c.logprobs else None,
                "finish_reason": c.finish_reason} for c in sub.choices]
    return {"id": sub.id, "object": "chat.completion", "created": sub.created, "model": model,
            "choices": choices, "usage": usage(sub.choices, sub.prompt_ids)}


def chat_stream(sub: Submission, model: str, include_usage: bool, tokenizer) -> AsyncIterator[str]:
    head = {"id": sub.id, "object": "chat.completion.chunk", "created": sub.created, "model": model}
    chunk = lambda index, delta, lp=None, finish=None: sse(
        {**head, "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]})

    async def chunks() -> AsyncIterator[str]:
        for c in sub.choices:
            yield chunk(c.index, {"role": "assistant", "content": ""})
        async for c, d in sub.deltas():
            c.add(d)
            lp = chat_logprobs(tokenizer, d.logprobs) if d.logprobs else None
            if d.text or lp:
                yield chunk(c.index, {"content": d.text}, lp)
            if d.finished:
                yield chunk(c.index, {}, None, d.finish_reason)

    return sse_stream(sub, head, include_usage, chunks())


def stream_error(e: LowbitError) -> str:
    """A failure after the stream started: an error event, then the end of the stream."""
    return sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}}) + "data: [DONE]\n\n"


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else ""
