"""`lowbit bench expert-cache`: replay a routing trace through the eviction policies.

The trace comes from `--record-routing FILE` (the engine's real routing), or is drawn
(`--zipf S`): each step, each layer and each token picks top-k distinct experts with
probability proportional to 1 / rank**S, over a per-layer random ranking of the experts
(seeded), so that every layer has its own hot set. Each policy is reported beside Belady's
offline optimum at the same slot count and beside A0 (evict the expert the trace uses least:
the best online policy on a trace whose steps are drawn independently, as --zipf's are), and with --prefetch, the gain of admitting the
experts the previous layer's pre-gating predicted (recorded traces only).
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from lowbit.bench.record import md_table
from lowbit.engine.expert_policy import SIM_POLICIES, RoutingTrace, load_trace, simulate
from lowbit.errors import LowbitError
from lowbit.kernels.expert_copy import copy_experts, zero_copy_refusal


def zipf_trace(num_experts: int, top_k: int, num_layers: int, steps: int, s: float,
               tokens: int = 1, seed: int = 0) -> RoutingTrace:
    """Synthetic decode routing with Zipf(s) expert popularity per layer."""
    if not 1 <= top_k <= num_experts:
        raise LowbitError(f"--top-k must be in 1..{num_experts}, got {top_k}")
    rng = random.Random(seed)
    ranks = [rng.sample(range(num_experts), num_experts) for _ in range(num_layers)]
    weights = [1.0 / (r + 1) ** s for r in range(num_experts)]
    trace = RoutingTrace(num_experts, top_k, list(range(num_layers)))
    for _ in range(steps):
        step = []
        for layer in range(num_layers):
            toks = []
            for _ in range(tokens):
                picked: list[int] = []
                while len(picked) < top_k:
                    e = ranks[layer][rng.choices(range(num_experts), weights)[0]]
                    if e not in picked:
                        picked.append(e)
                toks.append(picked)
            step.append(toks)
        trace.steps.append(step)
        trace.preds.append(None)
    return trace


def popularity(trace: RoutingTrace) -> dict:
    """How skewed the trace's expert choice is: per layer, the least-squares slope of
    log(picks) against log(rank) over the experts picked at least once, negated (a Zipf(s)
    popularity gives about s), and the share of picks that go to the layer's most picked
    quarter of experts (25 % for uniform routing, in the limit). Sorting turns sampling noise
    into apparent skew on short traces, so compare with a drawn trace of the same length:
    top-8 of 128 over 64 steps fits 0.46 (41 % share) for uniform draws, and 1.04 (71 %) for
    Zipf(1.0) over 128. Reported as the mean over layers and the layers' range."""
    fits, shares = [], []
    for li in range(len(trace.moe_layers)):
        counts = torch.zeros(trace.num_experts, dtype=torch.float64)
        for step in trace.steps:
            for tok in step[li]:
                counts[torch.as_tensor(tok, dtype=torch.long)] += 1
        c = counts.sort(descending=True).values
        total = float(c.sum())
        if total == 0:
            continue
        shares.append(float(c[:max(1, trace.num_experts // 4)].sum()) / total)
        c = c[c > 0]
        if len(c) < 2:
            continue
        x = torch.arange(1, len(c) + 1, dtype=torch.float64).log()
        y = c.log()
        xm, ym = x.mean(), y.mean()
        fits.append(-float(((x - xm) * (y - ym)).sum() / (x - xm).pow(2).sum()))
    if not shares:
        raise LowbitError("the trace routes no tokens")

    def summary(v: list[float]) -> dict:
        return {"mean": round(sum(v) / len(v), 4), "min": round(min(v), 4), "max": round(max(v), 4)}
    return {"zipf_fit": summary(fits) if fits else None, "top_quarter_share": summary(shares)}


def compare(trace: RoutingTrace, slots: list[int], policies: list[str], prefetch: bool) -> list[dict]:
    """One row per (slots, policy): hit rate, and its share of Belady's and of A0's at those
    slots (A0: the best online policy when the steps' experts are drawn independently)."""
    rows = []
    for n in slots:
        best = simulate(trace, n, "belady").hit_rate
        a0 = simulate(trace, n, "a0").hit_rate
        for p in policies:
            r = simulate(trace, n, p, prefetch=prefetch and p not in ("belady", "a0"))
            rows.append({"slots": n, "policy": p, "hit_rate": round(r.hit_rate, 4),
                         "of_belady": round(r.hit_rate / best, 4) if best else None,
                         "of_a0": round(r.hit_rate / a0, 4) if a0 else None,
                         "misses_per_step": round(r.misses / max(1, len(trace.steps)), 3),
                         "copies_per_step": round((r.misses + r.prefetched) / max(1, len(trace.steps)), 3),
                         "prefetch_hits": r.prefetch_hits})
    return rows


def h2d_bandwidth(device: str, nbytes: int = 256 << 20, repeats: int = 5) -> float | None:
    """Pinned host -> device copy bandwidth in bytes/s (the best of `repeats`), what a miss
    pays per byte; None off CUDA."""
    if not str(device).startswith("cuda"):
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return nbytes / best


def zero_copy_bandwidth(device: str, row_bytes: int = 2_752_512, rows: int = 8,
                        repeats: int = 5) -> float | None:
    """Bytes/s of the expert copy kernel (lowbit.kernels.expert_copy) reading `rows` pinned
    rows of `row_bytes` (default: one Qwen3-30B-A3B nvfp4 expert) into device slots, what a
    decode graph's miss pays per byte (the best of `repeats`); None off CUDA or without
    zero-copy reads."""
    if not str(device).startswith("cuda") or zero_copy_refusal(torch.device(device)) is not None:
        return None
    src = {"x": torch.empty(rows * 2, row_bytes, dtype=torch.uint8, pin_memory=True)}
    dst = {"x": torch.empty(rows, row_bytes, dtype=torch.uint8, device=device)}
    pairs = torch.tensor([[2 * i + 1, i] for i in range(rows)], device=device)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy_experts(pairs, src, dst)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return rows * row_bytes / best


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, help="routing trace written by --record-routing FILE")
    p.add_argument("--zipf", type=float, default=None, metavar="S",
                   help="instead of --trace: draw a trace with Zipf(S) expert popularity")
    p.add_argument("--experts", type=int, default=128, help="--zipf: experts per layer")
    p.add_argument("--top-k", type=int, default=8, help="--zipf: experts per token")
    p.add_argument("--layers", type=int, default=48, help="--zipf: MoE layers")
    p.add_argument("--steps", type=int, default=256, help="--zipf: decode steps")
    p.add_argument("--slots", default="", help="slots per layer, comma-separated (default: 25%% and 50%% of the experts)")
    p.add_argument("--policy", default=",".join(SIM_POLICIES),
                   help=f"policies, comma-separated, of {', '.join(SIM_POLICIES)}")
    p.add_argument("--prefetch", action="store_true", help="admit the recorded pre-gating guesses first")
    p.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    if (args.trace is None) == (args.zipf is None):
        raise LowbitError("give --trace FILE (from --record-routing) or --zipf S")
    trace = load_trace(args.trace) if args.trace else zipf_trace(
        args.experts, args.top_k, args.layers, args.steps, args.zipf)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    bad = [p for p in policies if p not in SIM_POLICIES]
    if bad:
        raise LowbitError(f"unknown policy {bad[0]!r}; use {', '.join(SIM_POLICIES)}")
    try:
        slots = [int(s) for s in args.slots.split(",") if s.strip()]
    except ValueError:
        raise LowbitError(f"--slots takes comma-separated integers, got {args.slots!r}") from None
    slots = slots or [max(1, trace.num_experts // 4), max(1, trace.num_experts // 2)]
    if any(n < 1 for n in slots):
        raise LowbitError(f"--slots must be positive integers, got {args.slots!r}")
    rows = compare(trace, slots, policies, args.prefetch)
    pop = popularity(trace)
    if args.json:
        print(json.dumps({"kind": "expert-cache", "trace": args.trace or f"zipf {args.zipf}",
                          "num_experts": trace.num_experts, "steps": len(trace.steps), "popularity": pop,
                          "rows": rows}, indent=1))
        return 0
    fit, top = pop["zipf_fit"], pop["top_quarter_share"]
    print(f"popularity over {len(trace.moe_layers)} layers: fitted Zipf exponent "
          + ("-" if fit is None else f"{fit['mean']:.2f} (layers {fit['min']:.2f}-{fit['max']:.2f})")
          + f"; the most picked quarter of the experts takes {top['mean']:.1%} of the picks "
          f"(layers {top['min']:.1%}-{top['max']:.1%})")
    headers = ["slots", "policy", "hit rate", "of Belady", "of A0", "misses/step", "copies/step",
               "prefetch hits"]
    print(md_table(headers, [[r["slots"], r["policy"], f"{r['hit_rate']:.1%}",
                              "-" if r["of_belady"] is None else f"{r['of_belady']:.1%}",
                              "-" if r["of_a0"] is None else f"{r['of_a0']:.1%}",
                              r["misses_per_step"], r["copies_per_step"], r["prefetch_hits"]] for r in rows]))
    return 0
