"""Kernels per decode step, from a torch profile of the engine's own steps.

`profile_decode(engine, batch, steps)` puts `batch` one-token requests into decode, then
profiles `steps` engine steps (the public step: schedule, graph replay or eager forward,
sampling, the token read-back) and reports per step:
  kernels         GPU kernels launched (inside a replayed graph too: CUPTI records each node)
  per_layer       kernels / decoder layers
  kernel_us       the sum of those kernels' GPU times
  step_us         wall time of a step (host included), timed over the same number of steps
                  just before the profiled ones, without the profiler (which slows the host)
  overhead        step_us / kernel_us: 1.0 when the GPU runs back to back; the host and the
                  gaps between kernels account for the rest
  top             the ten kernels with the most GPU time per step (name, count, us)
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


def _summary(prof, steps: int, layers: int, step_us: float, top: int) -> dict:
    """Kernels per step (and per layer), their GPU time, the wall time against it, and the
    `top` kernels by time (name, launches and us per step)."""
    kernels = _kernel_events(prof)
    names, times = Counter(), Counter()
    for e in kernels:
        names[e.name] += 1
        times[e.name] += e.device_time
    busy = sum(times.values()) / steps
    return {"steps": steps, "kernels": len(kernels) / steps, "per_layer": len(kernels) / steps / layers,
            "kernel_us": busy, "step_us": step_us, "overhead": step_us / max(busy, 1e-9),
            "top": [(n[:80], names[n] / steps, times[n] / steps) for n, _ in times.most_common(top)]}


def profile_decode(engine, batch: int = 1, steps: int = 8, context: int = 64) -> dict | None:
    if engine.device.type != "cuda":
        return None
    sp = SamplingParams(temperature=0.0, max_tokens=2 * steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % engine.arch.vocab_size for j in range(context)], sp)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    for _ in range(2):  # capture / warm the bucket outside the profile
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return {"batch": batch, **_summary(prof, steps, engine.arch.num_layers, 1e6 * wall / steps, 10)}


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


def format_profile(p: dict) -> str:
    if p.get("prefill"):
        head = (f"prefill of {p['batch']} tokens: {p['kernels']:.0f} kernels "
                f"({p['per_layer']:.1f} per layer), kernels {p['kernel_us']:.0f} us, wall "
                f"{p['step_us']:.0f} us ({p['overhead']:.2f}x the kernel time)")
        rows = [f"    {n:<80} x{c:<6.1f} {t:8.1f} us" for n, c, t in p["top"]]
        return "\n".join([head, *rows])
    head = (f"B={p['batch']}: {p['kernels']:.0f} kernels per step ({p['per_layer']:.1f} per layer), "
            f"kernels {p['kernel_us']:.0f} us, step {p['step_us']:.0f} us "
            f"({p['overhead']:.2f}x the kernel time)")
    rows = [f"    {n:<80} x{c:<6.1f} {t:8.1f} us" for n, c, t in p["top"]]
    return "\n".join([head, *rows])
