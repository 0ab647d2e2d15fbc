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


def _event(name: str, start: float, end: float, parent=None, cpu: bool = True):
    from types import SimpleNamespace

    import torch
    kind = torch.autograd.DeviceType.CPU if cpu else torch.autograd.DeviceType.CUDA
    return SimpleNamespace(name=name, device_type=kind, time_range=SimpleNamespace(start=start, end=end),
                           cpu_parent=parent)


def test_host_calls_rank_runtime_calls_and_count_top_level_ops():
    from lowbit.bench.step_profile import _host_calls
    top = _event("aten::copy_", 0, 9)
    events = [_event("cudaGraphLaunch", 0, 300), _event("cudaGraphLaunch", 400, 700),
              _event("cudaMemcpyAsync", 10, 20), _event("cudaMemcpyAsync", 30, 45),
              top, _event("aten::slice", 1, 2), _event("aten::as_strided", 2, 3, parent=top),
              _event("cudaMemcpyAsync", 0, 1000, cpu=False)]  # a device-side record: not the host's
    out = _host_calls(events, steps=2)
    assert out["host_calls"] == [("cudaGraphLaunch", 1.0, 300.0), ("cudaMemcpyAsync", 1.0, 12.5)]
    assert out["host_ops"] == 1.0  # copy_ and slice are top-level, the nested one is not: 2 ops / 2 steps
    p = {"batch": 1, "kernels": 10, "per_layer": 2.0, "kernel_us": 120.0, "busy_us": 80.0, "step_us": 88.0,
         "overhead": 1.1, "top": [], "host_us": {"prepare": 5.0}, **out}
    assert "cudaGraphLaunch x1.0 300 us" in format_profile(p)


def test_host_spans_keep_each_phases_longest_lap_and_the_footer_names_a_lopsided_one(monkeypatch):
    from lowbit.engine import metrics
    from lowbit.engine.metrics import HostSpans

    clock = iter([0.0, 0.000010, 0.000030, 1.0, 1.000010, 1.001010])  # us: replay 20, then 1,000
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    spans = HostSpans()
    spans.reset(on=True)
    for _ in range(2):
        spans.start()
        spans.lap("prepare")
        spans.lap("replay")
    mean, peak = spans.per_step_us(), spans.peak_us()
    assert round(mean["replay"]) == 510 and round(peak["replay"]) == 1000 and round(peak["prepare"]) == 10
    p = {"batch": 1, "kernels": 10, "per_layer": 2.0, "kernel_us": 120.0, "busy_us": 80.0, "step_us": 88.0,
         "overhead": 1.1, "top": [], "host_us": {"prepare": 20.0, "replay": 100.0},
         "host_us_max": {"prepare": 30.0, "replay": 700.0}}
    text = format_profile(p)
    assert "replay 100 (max 700)" in text and "prepare 20," in text and "prepare 20 (max" not in text
