"""A small async client for any OpenAI-compatible server (lowbit, vLLM, SGLang,
llama-server): model list, /tokenize, Prometheus /metrics, and one streamed request
timed chunk by chunk.

Times are time.perf_counter() seconds, taken when a server-sent event is parsed.
Every event with new output counts as a token arrival (see _is_token_chunk). The token
count comes from the final `usage` event (`stream_options.include_usage`); without it,
the arrivals are counted.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    send: float
    planned_prompt_tokens: int
    first: float | None = None  # first token chunk
    chunks: list[float] = field(default_factory=list)  # arrival time of every token chunk
    end: float | None = None
    prompt_tokens: int | None = None  # from usage
    completion_tokens: int | None = None  # from usage
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.first is not None

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunks)

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.planned_prompt_tokens

    def as_dict(self, t0: float) -> dict:
        rel = lambda t: None if t is None else round(t - t0, 9)
        return {"send": rel(self.send), "first": rel(self.first), "end": rel(self.end),
                "chunks": [rel(t) for t in self.chunks], "prompt_tokens": self.input_tokens,
                "completion_tokens": self.output_tokens, "usage": self.completion_tokens is not None,
                "ok": self.ok, "error": self.error}


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels} value` lines -> {"name{labels}": value}; comments and junk skipped."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "}" in line:
            name, _, rest = line.rpartition("}")
            name, parts = name + "}", rest.split()
        else:
            name, *parts = line.split()
        try:
            out[name] = float(parts[0])
        except (IndexError, ValueError):
            continue
    return out


def _is_token_chunk(obj: dict) -> bool:
    """A streamed event that carries generated output: any event with choices, except a
    chat delta holding only the role and a closing event that carries nothing but the
    finish reason (chat `delta: {}`, or completion text "" with no logprobs). Text may
    otherwise be empty (a server without a tokenizer streams ids only; a detokenizer may
    hold back part of a character)."""
    for ch in obj.get("choices") or []:
        delta = ch.get("delta")
        if ch.get("finish_reason") and not _carries_output(ch, delta):
            continue
        if delta is None or set(delta) - {"role"}:
            return True
    return False


def _carries_output(choice: dict, delta: dict | None) -> bool:
    if delta is not None:
        return any(v not in (None, "", []) for k, v in delta.items() if k != "role")
    return bool(choice.get("text")) or bool(choice.get("logprobs")) or bool(choice.get("token_ids"))


class Client:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = None,
                 max_connections: int = 64) -> None:
        self.base = normalize_base_url(base_url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout),
                                      limits=httpx.Limits(max_connections=max_connections,
                                                          max_keepalive_connections=max_connections))

    async def close(self) -> None:
        await self.http.aclose()

    async def models(self) -> list[str]:
        r = await self.http.get(f"{self.base}/v1/models")
        r.raise_for_status()
        return [m["id"] for m in r.json().get("data", [])]

    async def tokenize(self, text: str, model: str) -> list[int] | None:
        """Token ids from the server's /tokenize (vLLM/SGLang or llama-server shape), or None."""
        for body in ({"model": model, "prompt": text}, {"content": text}):
            try:
                r = await self.http.post(f"{self.base}/tokenize", json=body)
            except httpx.HTTPError:
                return None
            if r.status_code == 200:
                toks = r.json().get("tokens")
                if isinstance(toks, list) and toks and all(isinstance(t, int) for t in toks):
                    return toks
        return None

    async def metrics(self) -> dict[str, float] | None:
        try:
            r = await self.http.get(f"{self.base}/metrics")
        except httpx.HTTPError:
            return None
        return parse_prometheus(r.text) if r.status_code == 200 else None

    async def stream(self, endpoint: str, payload: dict, planned_prompt_tokens: int) -> RequestResult:
        res = RequestResult(send=time.perf_counter(), planned_prompt_tokens=planned_prompt_tokens)
        try:
            async with self.http.stream("POST", f"{self.base}{endpoint}", json=payload) as r:
                if r.status_code != 200:
                    body = (await r.aread()).decode(errors="replace")[:300]
                    res.error = f"HTTP {r.status_code}: {body}"
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    obj = json.loads(data)
                    if obj.get("error"):
                        res.error = str(obj["error"])[:300]
                        break
                    if _is_token_chunk(obj):
                        res.first = res.first or now
                        res.chunks.append(now)
                    usage = obj.get("usage")
                    if usage:
                        res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
                        res.completion_tokens = usage.get("completion_tokens", res.completion_tokens)
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            res.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            res.end = time.perf_counter()
        if not res.error and res.first is None:
            res.error = "the stream carried no tokens"
        return res
