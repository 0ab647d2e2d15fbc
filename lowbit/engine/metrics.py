"""Engine statistics: counters and latency histograms, read by the server's /metrics.

The engine thread writes, the server thread reads; every field is a number or a list of
numbers updated in place, so a reader sees a slightly stale but consistent-enough view.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last is +Inf
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le label, cumulative count) pairs in Prometheus order, +Inf last."""
        out, total = [], 0
        for le, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += n
            out.append((le, total))
        return out


@dataclass
class EngineStats:
    time_to_first_token: Histogram = field(default_factory=Histogram)
    inter_token_latency: Histogram = field(default_factory=Histogram)
    e2e_request_latency: Histogram = field(default_factory=Histogram)
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    request_success_total: dict[str, int] = field(default_factory=dict)  # finish reason -> n

    def on_token(self, arrival: float, last: float | None, now: float) -> None:
        self.generation_tokens_total += 1
        if last is None:
            self.time_to_first_token.observe(now - arrival)
        else:
            self.inter_token_latency.observe(now - last)

    def on_finish(self, reason: str, arrival: float, now: float) -> None:
        self.request_success_total[reason] = self.request_success_total.get(reason, 0) + 1
        self.e2e_request_latency.observe(now - arrival)


class HostSpans:
    """Host time per phase of a step, for lowbit.bench.step_profile: `start()` at the top of
    a step, then `lap(name)` adds the time since the last lap to `name`. Off (the default)
    every call returns at once. Phases: plan (speculative drafts), schedule, propose, the
    step's inputs in four (lists: the per-token host lists; stage: the graph bucket and the
    pinned buffers filled; upload: the copies to the device and the on-device fills of
    pending and drafted tokens; prepare: the device views and the batch), replay (a CUDA
    graph's launch call alone: cudaGraphLaunch, whose host cost grows with the graph), launch (the rest of the launch: an eager forward, a
    plain step's sampling and read-back), logits (a verify step's row gather, lm_head and the
    upload of its lists), accept (a verify step's acceptance launched: the argmax, or the
    rule's ops), read wait (the host blocked on the device for a step's tokens), update
    (tokens appended, text, deltas), follow (the MTP layer's follow-up)."""

    def __init__(self) -> None:
        self.on = False
        self.total: Counter = Counter()
        self.peak: Counter = Counter()  # the longest single lap of each phase, s
        self.steps = 0
        self._t = 0.0

    def reset(self, on: bool) -> None:
        self.on, self.total, self.peak, self.steps = on, Counter(), Counter(), 0

    def start(self) -> None:
        if self.on:
            self._t = time.perf_counter()
            self.steps += 1

    def lap(self, name: str) -> None:
        if self.on:
            now = time.perf_counter()
            self.total[name] += now - self._t
            self.peak[name] = max(self.peak[name], now - self._t)
            self._t = now

    def per_step_us(self) -> dict[str, float]:
        return {k: 1e6 * v / max(self.steps, 1) for k, v in self.total.items()}

    def peak_us(self) -> dict[str, float]:
        """The longest single lap of each phase, us: a mean that one slow lap makes (a
        garbage collection, a graph's first launch) shows here as a peak near steps x mean."""
        return {k: 1e6 * v for k, v in self.peak.items()}

