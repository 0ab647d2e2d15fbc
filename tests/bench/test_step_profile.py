"""The decode-step profile's busy time: the union of kernel spans, which overlap when kernels
launch early (programmatic dependent launch)."""

from __future__ import annotations

from lowbit.bench.step_profile import _union_us, format_profile


def test_union_of_overlapping_and_disjoint_spans():
    assert _union_us([]) == 0
    assert _union_us([(0, 10), (5, 12), (20, 25)]) == 17  # overlap counted once, gap not at all
    assert _union_us([(3, 4), (0, 10)]) == 10  # a span inside another adds nothing
    assert _union_us([(0, 2), (2, 5)]) == 5


def test_format_reports_busy_time_against_the_step():
    p = {"batch": 1, "kernels": 10, "per_layer": 2.0, "kernel_us": 120.0, "busy_us": 80.0,
         "step_us": 88.0, "overhead": 1.1, "top": [("k", 10.0, 120.0)]}
    assert "kernels 120 us (80 us busy), step 88 us (1.10x the busy time)" in format_profile(p)
