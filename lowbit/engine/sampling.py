"""SamplingParams (vLLM's names) and the device-side sampler.

Shapes: B sequences, V vocabulary. Sampling never reads values back to the host: greedy is
an argmax; random sampling draws Exp(1) noise and takes argmax(p / noise), which picks
token i with probability p_i and needs no cumulative sum on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lowbit.errors import LowbitError

MAX_LOGPROBS = 20
MAX_N = 16
MAX_STOP = 16


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _refuse(msg: str):
    raise LowbitError(msg)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # top-n alternatives per generated token (0: the chosen one only)
    prompt_logprobs: int | None = None  # the same for prompt tokens (echo)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        self._validate_sampling()
        self._validate_outputs()

    def _validate_sampling(self) -> None:
        finite = lambda v: isinstance(v, (int, float)) and math.isfinite(v)
        if not finite(self.temperature) or self.temperature < 0:
            _refuse(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not finite(self.top_p) or not 0 < self.top_p <= 1:
            _refuse(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            _refuse(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k}")
        if not finite(self.min_p) or not 0 <= self.min_p <= 1:
            _refuse(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _refuse(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if not _is_int(self.n) or self.n < 1:
            _refuse(f"n must be a positive integer, got {self.n}")
        if not finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            _refuse(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not finite(v) or not -2 <= v <= 2:
                _refuse(f"{name} must be in [-2, 2], got {v}")
        if self.seed is not None and (not _is_int(self.seed) or not -2**63 <= self.seed < 2**64):
            _refuse(f"seed must be a 64-bit integer, got {self.seed}")

    def _validate_outputs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                _refuse(f"{name} must be an integer in 0..{MAX_LOGPROBS}, got {v}")
        if self.n > MAX_N:
            _refuse(f"n must be at most {MAX_N}, got {self.n}")
        if len(self.stop) > MAX_STOP:
            _refuse(f"at most {MAX_STOP} stop strings are allowed, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            _refuse("stop strings must be non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            _refuse("stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor,
                    rep: torch.Tensor, pres: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """logits [B, V]; counts [B, V] output-token counts; prompt_mask [B, V] bool.
    rep/pres/freq [B]. Repetition penalty (CTRL-style) covers prompt and output tokens."""
    seen = prompt_mask | (counts > 0)
    r = rep[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - freq[:, None] * counts - pres[:, None] * (counts > 0).float()


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks; returns probabilities [B, V]."""
    V = logits.shape[-1]
    logits = logits / temperature.clamp(min=1e-5)[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)[:, None]
    drop = rank >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    cum = probs.cumsum(-1) - probs  # mass strictly before each token
    drop |= cum >= top_p[:, None]
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits).softmax(-1)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] int64, on the logits' device."""
    dev = logits.device
    greedy = logits.argmax(-1)
    if all(p.greedy for p in params):
        return greedy
    t = torch.tensor([p.temperature for p in params], device=dev)
    tk = torch.tensor([p.top_k for p in params], device=dev)
    tp = torch.tensor([p.top_p for p in params], device=dev)
    mp = torch.tensor([p.min_p for p in params], device=dev)
    probs = filter_logits(logits, t, tk, tp, mp)
    noise = torch.stack([torch.empty_like(probs[0]).exponential_(generator=g) for g in generators])
    drawn = (probs / noise).argmax(-1)
    return torch.where(t == 0, greedy, drawn)


def penalize(logits: torch.Tensor, params: list[SamplingParams],
             history: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """Apply repetition/presence/frequency penalties to the rows that ask for them.
    logits [B, V]; history[b] = (prompt ids, output ids) of row b."""
    rows = [b for b, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    dev, V = logits.device, logits.shape[-1]
    counts = torch.zeros(len(rows), V, device=dev)  # [R, V]
    prompt_mask = torch.zeros(len(rows), V, dtype=torch.bool, device=dev)  # [R, V]
    for i, b in enumerate(rows):
        prompt, out = history[b]
        prompt_mask[i, torch.tensor(prompt, device=dev)] = True
        if out:
            out_t = torch.tensor(out, device=dev)
            counts[i].index_add_(0, out_t, torch.ones_like(out_t, dtype=counts.dtype))
    pick = lambda name: torch.tensor([getattr(params[b], name) for b in rows], device=dev)
    logits = logits.clone()
    logits[rows] = apply_penalties(logits[rows], counts, prompt_mask, pick("repetition_penalty"),
                                   pick("presence_penalty"), pick("frequency_penalty"))
    return logits


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int):
    """Log-probabilities of the model's distribution (before any sampling transform).
    logits [B, V], token_ids [B] -> chosen [B], top_ids [B, num_top], top_logprobs [B, num_top]."""
    logprobs = logits.float().log_softmax(-1)  # [B, V]
    chosen = logprobs.gather(1, token_ids[:, None].long())[:, 0]
    top_lp, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], token_ids[:, None][:, :0])
    return chosen, top_ids, top_lp
