"""Request: one sequence's state as it moves through the engine, and what the engine emits.

A request knows its tokens (prompt + generated so far) and how many of them are computed
(their K/V sit in the cache). The scheduler's only job is to close that gap. With async
scheduling a token can be known before the host has read it: sampled by a step still on
the device (`num_pending_tokens`), it is already the next step's input there.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from lowbit.engine.detokenizer import IncrementalDetokenizer
from lowbit.engine.sampling import SamplingParams
from lowbit.errors import LowbitError

PENDING_TOKEN = 0  # what a pending token reads as on the host: any id inside the vocabulary


class RequestRejected(LowbitError):
    """A request the engine refuses up front; `code` is the OpenAI error code, when one fits."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """Log-probability of one chosen token and the `top` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    detokenizer: IncrementalDetokenizer | None = None
    prompt: str | None = None
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits at the last admission
    draft_token_ids: list[int] = field(default_factory=list)  # proposed, not yet verified
    num_pending_tokens: int = 0  # sampled by a launched step, not yet read back to the host
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    text: str = ""
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens, pending tokens and draft tokens: what the computed tokens catch up with."""
        return self.num_tokens + self.num_pending_tokens + len(self.draft_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_known_tokens - self.num_computed_tokens

    def known_tokens(self, start: int, n: int) -> list[int]:
        """Known tokens start..start+n: the real ones, then the pending ones (PENDING_TOKEN:
        the runner fills them in on the device), then the drafts."""
        ids = self.token_ids[start:start + n]
        if len(ids) < n:
            at = max(0, start - self.num_tokens)
            ids += ([PENDING_TOKEN] * self.num_pending_tokens + self.draft_token_ids)[at:at + n - len(ids)]
        return ids

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None


@dataclass
class RequestDelta:
    """What one step added to one request: the engine's streaming unit."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first delta only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    index: int = 0
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict = field(default_factory=dict)
    request_id: str = ""
    prompt_logprobs: list[TokenLogprob | None] | None = None
