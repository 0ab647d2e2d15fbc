"""Kernels per decode step, from a torch profile of the engine's own steps.

`profile_decode(engine, batch, steps)` puts `batch` one-token requests into decode, then
profiles `steps` engine steps (the public step: schedule, graph replay or eager forward,
sampling, the token read-back) and reports per step:
  kernels         GPU kernels launched (inside a replayed graph too: CUPTI records each node)
  per_layer       kernels / decoder layers
  kernel_us       the sum of those kernels' GPU times. With programmatic dependent launch
                  (lowbit.kernels.launch) a kernel starts before the one ahead of it ends and
                  its span includes its wait, so spans overlap and this sum overstates
  busy_us         the time at least one kernel ran: the union of the kernel spans
  step_us         wall time of a step (host included), timed over the same number of steps
                  just before the profiled ones, without the profiler (which slows the host)
  overhead        step_us / busy_us: 1.0 when the GPU runs back to back; the host and the
                  gaps between kernels account for the rest
  top             the 30 kernels with the most GPU time per step (name, count, us)
  tokens_per_step tokens the timed steps emitted, per step (all sequences): `batch` for
                  plain decode, more with speculative decoding's accepted drafts
  host_us         the timed steps' host time per phase, us a step (lowbit.engine.metrics
                  .HostSpans): "read wait" is the host blocked on the device, the rest is
                  host work; with async scheduling it overlaps the device, without it
                  (speculative decoding) the device idles through it
  host_us_max     the longest single lap of each phase, us: a mean made by one slow lap
  host_calls      the profiled steps' CUDA runtime calls on the host (cudaGraphLaunch,
                  cudaMemcpyAsync, cudaLaunchKernel, cudaEventSynchronize, ...): name, calls
                  and host us a step, the most time first; and host_ops, the count of
                  top-level torch ops a step (each costs its dispatch on the host). Under the
                  profiler a call costs more than without it: read them as shares
`profile_prefill(engine, tokens)` does the same for one prompt of `tokens` tokens (the
engine's own prefill steps, chunked as the scheduler chunks them; kernels are summed over
the whole prompt, and `batch` is the prompt length).
It needs CUDA (CUPTI); elsewhere it returns None.
"""

from __future__ import annotations

import time
from collections import Counter

import torch

from lowbit.engine.sampling import SamplingParams


def _kernel_events(prof) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset", "[memory]"))]


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _host_calls(events, steps: int, top: int = 8) -> dict:
    """The host side of the profiled steps: CUDA runtime calls (name, calls a step, us a
    step; the costliest `top`) and top-level torch ops a step."""
    calls, us, ops = Counter(), Counter(), 0
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        if e.name.startswith("cuda"):
            calls[e.name] += 1
            us[e.name] += e.time_range.end - e.time_range.start
        elif e.name.startswith("aten::") and e.cpu_parent is None:
            ops += 1
    return {"host_calls": [(n, calls[n] / steps, us[n] / steps) for n, _ in us.most_common(top)],
            "host_ops": ops / steps}


def _summary(prof, steps: int, layers: int, step_us: float, top: int) -> dict:
    """Kernels per step (and per layer), their GPU time, the wall time against it, and the
    `top` kernels by time (name, launches and us per step)."""
    kernels = _kernel_events(prof)
    names, times = Counter(), Counter()
    for e in kernels:
        names[e.name] += 1
        times[e.name] += e.device_time
    busy = _union_us([(e.time_range.start, e.time_range.end) for e in kernels]) / steps
    return {"steps": steps, "kernels": len(kernels) / steps, "per_layer": len(kernels) / steps / layers,
            "kernel_us": sum(times.values()) / steps, "busy_us": busy, "step_us": step_us,
            "overhead": step_us / max(busy, 1e-9),
            "top": [(n[:80], names[n] / steps, times[n] / steps) for n, _ in times.most_common(top)],
            **_host_calls(prof.events(), steps)}


def into_decode(engine, batch: int, context: int, max_tokens: int, rehearse: bool = False,
                warm_steps: int = 2) -> None:
    """`batch` greedy requests of `context` prompt tokens, prefilled and `warm_steps` decode
    steps in (the bucket's graph captured and warm), for a measurement of the steps that
    follow. `rehearse`: run the same requests to the end once first (profile_decode)."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [[(7 * i + j) % engine.arch.vocab_size for j in range(context)] for i in range(batch)]
    if rehearse:
        for p in prompts:
            engine.add_request(p, sp)
        while engine.has_unfinished():
            engine.step()
    for p in prompts:
        engine.add_request(p, sp)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    for _ in range(warm_steps):
        engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def profile_decode(engine, batch: int = 1, steps: int = 8, context: int = 64, step_tokens: int = 1,
                   rehearse: bool = False) -> dict | None:
    """`step_tokens`: the most tokens a step emits per sequence (k + 1 with speculation).
    `rehearse`: run the same requests to the end once first, so that graphs of every shape
    the steps meet (a speculative step's verify buckets vary with its drafts) are captured
    before the timing."""
    if engine.device.type != "cuda":
        return None
    into_decode(engine, batch, context, (2 * steps + 4) * step_tokens + 8, rehearse)
    before = sum(r.num_tokens for r in engine.requests.values())
    engine.spans.reset(on=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    host, host_max = engine.spans.per_step_us(), engine.spans.peak_us()
    engine.spans.reset(on=False)
    emitted = sum(r.num_tokens for r in engine.requests.values()) - before
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return {"batch": batch, **_summary(prof, steps, engine.arch.num_layers, 1e6 * wall / steps, 30),
            "tokens_per_step": emitted / steps, "host_us": host, "host_us_max": host_max}


def profile_prefill(engine, tokens: int = 512, repeats: int = 2) -> dict | None:
    if engine.device.type != "cuda":
        return None
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    runs = iter(range(1 << 30))

    def run() -> None:  # a new prompt each time, so that no prefix of it is cached
        r = next(runs)
        engine.add_request([(13 * j + 7 * r + 5) % engine.arch.vocab_size for j in range(tokens)], sp)
        while engine.has_unfinished():
            engine.step()

    run()  # first-use compiles outside the timing
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        run()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / repeats
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        run()
        torch.cuda.synchronize()
    return {"batch": tokens, **_summary(prof, 1, engine.arch.num_layers, 1e6 * wall, 12), "prefill": True}


def _busy(p: dict) -> str:
    return f"{p['busy_us']:.0f}" if "busy_us" in p else "?"  # records before busy_us


def format_profile(p: dict) -> str:
    if p.get("prefill"):
        head = (f"prefill of {p['batch']} tokens: {p['kernels']:.0f} kernels "
                f"({p['per_layer']:.1f} per layer), kernels {p['kernel_us']:.0f} us "
                f"({_busy(p)} us busy), wall {p['step_us']:.0f} us ({p['overhead']:.2f}x the busy time)")
        rows = [f"    {n:<80} x{c:<6.1f} {t:8.1f} us" for n, c, t in p["top"]]
        return "\n".join([head, *rows])
    head = (f"B={p['batch']}: {p['kernels']:.0f} kernels per step ({p['per_layer']:.1f} per layer), "
            f"kernels {p['kernel_us']:.0f} us ({_busy(p)} us busy), step {p['step_us']:.0f} us "
            f"({p['overhead']:.2f}x the busy time)")
    if p.get("tokens_per_step", p["batch"]) != p["batch"]:
        head += f", {p['tokens_per_step']:.2f} tokens per step"
    rows = [f"    {n:<80} x{c:<6.1f} {t:8.1f} us" for n, c, t in p["top"]]
    host = []
    if p.get("host_us"):
        peak = p.get("host_us_max") or {}
        host.append("    host us a step (the longest lap where it is over 3x the mean): " + ", ".join(
            f"{k} {v:.0f}" + (f" (max {peak[k]:.0f})" if peak.get(k, 0) > 3 * v else "")
            for k, v in p["host_us"].items()))
    if p.get("host_calls"):
        host.append(f"    host CUDA calls a step (profiled; {p['host_ops']:.0f} top-level torch ops): "
                    + ", ".join(f"{n} x{c:.1f} {t:.0f} us" for n, c, t in p["host_calls"]))
    rows = host + rows
    return "\n".join([head, *rows])
