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
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def bad(msg: str):
            raise LowbitError(msg)

        finite = lambda v: isinstance(v, (int, float)) and math.isfinite(v)
        if not finite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not finite(self.top_p) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k}")
        if not finite(self.min_p) or not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be a positive integer, got {self.n}")
        if not finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not finite(v) or not -2 <= v <= 2:
                bad(f"{name} must be in [-2, 2], got {v}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad(f"logprobs must be an integer in 0..20, got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
