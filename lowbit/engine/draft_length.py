"""Draft length: how many drafts k a verify step should carry, from a cost model.

The cost model (`expected_rates`, `choose_draft_length`): a verify step over T = k + 1
tokens of each sequence costs t_v(T), a draft token t_d (0 for prompt lookup); with a_j the
share of steps whose drafts 0..j were all accepted, a sequence gains E(k) = 1 + a_0 + ...
+ a_(k-1) tokens per step, and the best k maximises E(k) / (t_v(k + 1) + k t_d); k = 0 is
no speculation.

`DraftLength` (--speculative-adaptive) feeds it as the engine serves, per batch-size bucket
(decoding sequences rounded up to a power of two), with k at most --num-speculative-tokens.
It learns from decode steps (every scheduled sequence decoding, none left out), keyed by
the k the step asked for, whatever the drafter gave (prompt lookup often finds fewer):
- t_v(k + 1): the step's wall-clock, from planning its drafts to the engine's reading its
  tokens, less its drafting; speculative steps run synchronously, so nothing of the step is
  left on the device then. The median of the last WINDOW steps. At k = 0 nothing is taken
  off: a model drafter still catches its KV up with the new tokens, part of what not
  drafting costs with it.
- t_d: a model drafter's wall-clock per draft position (the host reads its last draft, so
  its work is done when `propose` returns); 0 for ngram.
- a_j: per sequence asked for more than j drafts, the share whose drafts 0..j were all
  accepted (a draft not proposed counts as not accepted), decayed by DECAY every
  DECIDE_EVERY steps so that a change of workload shows.
Warm-up: a bucket's steps take k = 0, 1, ..., k_max in turn until every T has MIN_SAMPLES
and MIN_PROPOSED sequences were asked for k_max drafts (a_j from a handful of sequences
would decide on noise); then its k is chosen, again every DECIDE_EVERY of its steps, and
one step in EXPLORE_EVERY takes each other k in turn, so every T and every draft position
keeps being measured.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

WINDOW = 16  # step times kept per (bucket, T)
MIN_SAMPLES = 3  # per T (and of draft time), before a bucket's first choice
MIN_PROPOSED = 16  # sequences asked for k_max drafts (all buckets), before a bucket's first choice
EXPLORE_EVERY = 8  # one step in this many runs another k
DECIDE_EVERY = 32  # steps of a bucket between choices
DECAY = 0.9  # acceptance counts kept at each decay


def expected_rates(accept_through: list[float], verify_s: dict[int, float], draft_s: float) -> list[float]:
    """The cost model: expected tokens per second of one sequence for k = 0..len(accept_through)
    drafts. accept_through[j]: measured share of steps whose drafts 0..j were all accepted
    (SpecStats.accept_rate_per_position); verify_s[T]: seconds of a verify step over T tokens
    (measured at a few T, linear between them); draft_s: seconds per draft token."""
    known = sorted(verify_s)

    def verify(t: int) -> float:
        lo = max((x for x in known if x <= t), default=known[0])
        hi = min((x for x in known if x >= t), default=known[-1])
        if hi == lo:
            return verify_s[lo] if t <= known[-1] else verify_s[lo] * t / lo
        return verify_s[lo] + (verify_s[hi] - verify_s[lo]) * (t - lo) / (hi - lo)

    gains = [1.0]
    for a in accept_through:
        gains.append(gains[-1] + a)
    return [g / (verify(k + 1) + k * draft_s) for k, g in enumerate(gains)]


def choose_draft_length(accept_through: list[float], verify_s: dict[int, float], draft_s: float) -> int:
    """The k the cost model picks: the most expected tokens per second (0: do not speculate)."""
    rates = expected_rates(accept_through, verify_s, draft_s)
    return max(range(len(rates)), key=lambda k: (rates[k], -k))


def batch_bucket(num_seqs: int) -> int:
    return 1 << max(num_seqs - 1, 0).bit_length()


@dataclass
class Bucket:
    """One batch-size bucket's k and its step times."""

    k: int
    steps: int = 0
    chosen: bool = False
    verify: dict[int, deque] = field(default_factory=dict)  # T -> seconds
    draft: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # seconds per draft token

    def verify_s(self) -> dict[int, float]:
        return {t: statistics.median(s) for t, s in self.verify.items()}


class DraftLength:
    """The engine's k, per batch-size bucket, from the cost model over its own measurements."""

    def __init__(self, k_max: int, drafting_costs: bool, clock=time.perf_counter) -> None:
        self.k_max, self.drafting_costs, self.clock = k_max, drafting_costs, clock
        self.buckets: dict[int, Bucket] = {}
        self.proposed_at, self.accepted_at = [0.0] * k_max, [0.0] * k_max
        self.num_steps = 0
        self.history: list[dict] = []  # {"step", "batch_bucket", "k"} at each change

    def k_for(self, num_seqs: int) -> int:
        """The k of a step with `num_seqs` decoding sequences."""
        b = self.buckets.setdefault(batch_bucket(num_seqs), Bucket(self.k_max))
        b.steps += 1
        self.num_steps += 1
        if self.num_steps % DECIDE_EVERY == 0:
            self.proposed_at = [p * DECAY for p in self.proposed_at]
            self.accepted_at = [a * DECAY for a in self.accepted_at]
        if not self._ready(b):
            return b.steps % (self.k_max + 1)
        if not b.chosen or b.steps % DECIDE_EVERY == 0:
            self._choose(batch_bucket(num_seqs), b)
        if b.steps % EXPLORE_EVERY == 0:
            others = [k for k in range(self.k_max + 1) if k != b.k]
            return others[b.steps // EXPLORE_EVERY % len(others)]
        return b.k

    def record_step(self, num_seqs: int, k: int, step_s: float, draft_s: float,
                    outcomes: list[tuple[int, int]]) -> None:
        """A step of `num_seqs` decoding sequences that asked each for k drafts: its wall-clock,
        the part of it spent drafting, and per sequence (drafts it had room for, drafts accepted)."""
        b = self.buckets.setdefault(batch_bucket(num_seqs), Bucket(self.k_max))
        b.verify.setdefault(k + 1, deque(maxlen=WINDOW)).append(step_s - draft_s if k else step_s)
        if k and self.drafting_costs:
            b.draft.append(draft_s / k)
        for room, accepted in outcomes:
            for j in range(min(room, self.k_max)):
                self.proposed_at[j] += 1
                self.accepted_at[j] += j < accepted

    @property
    def accept_through(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    def inputs(self, b: Bucket) -> tuple[list[float], dict[int, float], float]:
        """The cost model's arguments from a bucket's measurements."""
        draft_s = statistics.median(b.draft) if self.drafting_costs else 0.0
        return self.accept_through, b.verify_s(), draft_s

    def current(self) -> dict[int, int]:
        """The k each bucket has chosen (none yet for a bucket still warming up)."""
        return {size: b.k for size, b in sorted(self.buckets.items()) if b.chosen}

    def _ready(self, b: Bucket) -> bool:
        counts = [len(b.verify.get(t, ())) for t in range(1, self.k_max + 2)]
        return (min(counts) >= MIN_SAMPLES and self.proposed_at[-1] >= MIN_PROPOSED
                and (not self.drafting_costs or len(b.draft) >= MIN_SAMPLES))

    def _choose(self, size: int, b: Bucket) -> None:
        k = choose_draft_length(*self.inputs(b))
        if k != b.k or not b.chosen:
            self.history.append({"step": self.num_steps, "batch_bucket": size, "k": k})
        b.k, b.chosen = k, True
