"""Request bodies of the OpenAI-compatible API, and their mapping to SamplingParams.

Fields follow the OpenAI API plus vLLM's sampling extras (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, skip_special_tokens). A sampling field
the request leaves out takes the model's generation_config.json value, as in vLLM, and
else the OpenAI default. Types are strict (`"n": true` or `"temperature": "0"` is a 400
naming the field), and a refused value names the request field it came from. Unknown
fields are accepted and logged, as OpenAI clients send fields a server may not know;
fields lowbit knows but cannot honour (logit_bias, suffix, tools that need a parser) are
refused.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from lowbit.engine.request import RequestRejected
from lowbit.engine.sampling import MODEL_DEFAULTS, SamplingParams
from lowbit.errors import LowbitError

log = logging.getLogger("lowbit")

PromptType = str | list[int] | list[str] | list[list[int]]
API_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def checked_params(fields: dict, names: dict[str, str]) -> SamplingParams:
    """SamplingParams(**fields); a refusal names the request field at fault (`names` maps
    a SamplingParams field to the request field it came from, where they differ)."""
    try:
        return SamplingParams(**fields)
    except LowbitError as e:
        bad = next((k for k, v in fields.items() if _refusal(k, v) == str(e)), None)
        raise RequestRejected(str(e), param=names.get(bad, bad)) from e


def _refusal(name: str, value) -> str | None:
    """The message SamplingParams refuses `name=value` with alone (None: it takes it)."""
    try:
        SamplingParams(**{name: value})
    except LowbitError as e:
        return str(e)
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    skip_special_tokens: bool = True

    def warn_unknown(self) -> None:
        if self.model_extra:
            log.warning("ignoring unknown request fields: %s", ", ".join(sorted(self.model_extra)))

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict,
                        prompt_logprobs: int | None = None, names: dict[str, str] | None = None) -> SamplingParams:
        if self.logit_bias:
            raise RequestRejected("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise RequestRejected("stream_options is only allowed with stream: true", param="stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        given = {k: getattr(self, k) for k in MODEL_DEFAULTS if getattr(self, k) is not None}
        return checked_params(dict(
            **{**API_DEFAULTS, **defaults, **given},
            n=self.n, seed=self.seed, max_tokens=max_tokens, stop=stop,
            stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens), names or {})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: PromptType
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def to_params(self, defaults: dict) -> SamplingParams:
        if self.suffix:
            raise RequestRejected("suffix is not supported", param="suffix")
        return self.sampling_params(self.max_tokens, self.logprobs, defaults,
                                    self.logprobs if self.echo and self.logprobs is not None else None,
                                    {"prompt_logprobs": "logprobs"})

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts, each a string or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise RequestRejected("the prompt is empty; give at least one token", param="prompt")
        return list(p)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None

    def to_params(self, defaults: dict) -> SamplingParams:
        if self.tools:
            raise RequestRejected("tool calling is not supported", param="tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestRejected("top_logprobs needs logprobs: true", param="top_logprobs")
        names = {"logprobs": "top_logprobs"}
        max_tokens = self.max_tokens
        if self.max_completion_tokens is not None:
            max_tokens, names["max_tokens"] = self.max_completion_tokens, "max_completion_tokens"
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults,
                                    names=names)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    tokens: list[int]
