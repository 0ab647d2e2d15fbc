"""SamplingParams (vLLM's names), the sampler's persistent device state, and the eager sampler.

Shapes: B sequences, V vocabulary, R = max_rows + 1 state rows. Sampling never reads values
back to the host: greedy is an argmax; random sampling draws Exp(1) noise and takes
argmax(p / noise), which picks token i with probability p_i and needs no cumulative sum on
the host.

SamplingState holds each running request's parameters in device tensors (one row per
request, written once by `assign`), so that lowbit.kernels.sample_op.sample_rows, and a
decode CUDA graph around it, read nothing from the host. `penalize` builds the same
penalties from host-side token lists every call: the independent twin the tests compare
the device counts against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lowbit.errors import LowbitError
from lowbit.kernels.sample_op import SampleMode, apply_penalties, filter_logits

__all__ = ["MODEL_DEFAULTS", "SamplingParams", "SamplingState", "SampleMode", "apply_penalties", "filter_logits",
           "model_sampling_defaults", "penalize", "token_logprobs"]

MAX_LOGPROBS = 20
MAX_N = 16
MAX_STOP = 16


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _refuse(msg: str):
    raise LowbitError(msg)


# the sampling fields a model's generation_config.json may recommend (a request that leaves
# one out takes the model's value: the server, and a start-up graph capture's default mode)
MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(generation_config: dict) -> dict:
    """The sampling settings a model's generation_config.json recommends."""
    return {k: generation_config[k] for k in MODEL_DEFAULTS if generation_config.get(k) is not None}


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


class SamplingState:
    """Per-request sampling parameters in persistent device tensors [R] (R = max_rows + 1;
    row max_rows is the scratch row that padded graph rows read and write), as
    lowbit.kernels.sample_op reads them: temperature, top_k (int32, 0: off), top_p, min_p,
    seed (int64), repetition_penalty, presence_penalty, frequency_penalty.

    counts [R, V] int32 (output-token counts) and prompt_mask [R, V] bool are for penalties
    only, so they exist once a request asks for penalties: allocated at construction with
    penalties=True, else at the first `assign` of such a request; once allocated they are
    never replaced. Only penalties-mode work reads them, and `mode_for` gives that mode only
    to batches holding such a request, so a graph captured in that mode sees the final
    tensors. Every tensor is written in place: captured graphs keep their addresses.
    """

    FLOATS = {"temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
              "presence_penalty": 0.0, "frequency_penalty": 0.0}  # the neutral (greedy) row

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str,
                 penalties: bool = False) -> None:
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, torch.device(device)
        self.scratch_row = max_rows
        n = max_rows + 1
        for name, neutral in self.FLOATS.items():
            setattr(self, name, torch.full((n,), neutral, dtype=torch.float32, device=self.device))
        self.top_k = torch.zeros(n, dtype=torch.int32, device=self.device)
        self.seed = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.counts: torch.Tensor | None = None  # [R, V] int32
        self.prompt_mask: torch.Tensor | None = None  # [R, V] bool
        if penalties:
            self._allocate_penalties()

    def _allocate_penalties(self) -> None:
        shape = (self.max_rows + 1, self.vocab_size)
        self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def assign(self, row: int, params: SamplingParams, prompt_ids: list[int],
               output_ids: list[int], seed: int | None = None) -> None:
        """Seat a request in `row` (once per request, or again after a preemption: the
        counts come from output_ids). seed overrides params.seed; with neither, a random
        row gets one from torch's default generator (a greedy row needs none)."""
        assert 0 <= row < self.max_rows, f"row {row} is outside 0..{self.max_rows - 1}"
        values = {"temperature": params.temperature, "top_p": params.top_p, "min_p": params.min_p,
                  "repetition_penalty": params.repetition_penalty,
                  "presence_penalty": params.presence_penalty,
                  "frequency_penalty": params.frequency_penalty}
        for name, v in values.items():  # fill_ on a one-row view: a kernel, not a host-to-device copy
            getattr(self, name)[row:row + 1].fill_(v)
        self.top_k[row:row + 1].fill_(max(params.top_k, 0))
        self.seed[row:row + 1].fill_(_int64(_pick_seed(seed if seed is not None else params.seed, params.greedy)))
        if params.has_penalties and self.counts is None:
            self._allocate_penalties()
        if self.counts is not None:
            self._fill_history(row, prompt_ids, output_ids)

    def _fill_history(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        self.prompt_mask[row].zero_()
        self.counts[row].zero_()
        if prompt_ids:
            self.prompt_mask[row].index_fill_(0, self._upload(prompt_ids), True)
        if output_ids:
            out = self._upload(output_ids)
            self.counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def _upload(self, ids: list[int]) -> torch.Tensor:
        """ids on the device without waiting for the stream (a seat happens while the
        previous step may still run)."""
        return torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)

    def release(self, row: int) -> None:
        """The row's request ended or was preempted: back to the neutral (greedy) row."""
        for name, neutral in self.FLOATS.items():
            getattr(self, name)[row:row + 1].fill_(neutral)
        self.top_k[row:row + 1].fill_(0)
        self.seed[row:row + 1].fill_(0)

    def mode_for(self, params: list[SamplingParams]) -> SampleMode:
        """The static sampler mode of a batch of these requests' rows."""
        random = [p for p in params if not p.greedy]
        return SampleMode(
            random=bool(random),
            filters=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in random),
            penalties=any(p.has_penalties for p in params))

    def snapshot(self) -> torch.Tensor | None:
        """A copy of the counts (None before any penalties), for `restore`: a graph
        capture's warm-up step samples, and its tokens must not count."""
        return None if self.counts is None else self.counts.clone()

    def restore(self, snapshot: torch.Tensor | None) -> None:
        if snapshot is not None:
            self.counts.copy_(snapshot)


def _pick_seed(seed: int | None, greedy: bool) -> int:
    if seed is not None or greedy:
        return seed or 0
    return int(torch.empty((), dtype=torch.int64).random_())  # 0..2^63 - 1


def _int64(v: int) -> int:
    """v modulo 2^64 as a signed 64-bit value (seeds may be given in 0..2^64 - 1)."""
    return (v + (1 << 63)) % (1 << 64) - (1 << 63)


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
