"""Summary statistics shared by the bench commands: mean, sd, percentiles, spread."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def mean_sd(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for fewer than two samples)."""
    if not xs:
        return math.nan, math.nan
    a = np.asarray(xs, dtype=float)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def percentile(xs: Sequence[float], q: float) -> float:
    """q in 0..100, linear interpolation between order statistics; nan when empty."""
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else math.nan


def distribution(xs: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean / median / p99 / min / max / std of xs times scale (e.g. 1e3 for seconds -> ms)."""
    if not xs:
        return {k: math.nan for k in ("mean", "median", "p99", "min", "max", "std")}
    a = np.asarray(xs, dtype=float) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99)),
            "min": float(a.min()), "max": float(a.max()), "std": float(a.std())}


def spread(xs: Sequence[float]) -> dict[str, float]:
    """median, min, max, q1, q3 and iqr of a sample."""
    a = np.asarray(xs, dtype=float)
    q1, q3 = np.percentile(a, [25, 75])
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max()),
            "q1": float(q1), "q3": float(q3), "iqr": float(q3 - q1)}
