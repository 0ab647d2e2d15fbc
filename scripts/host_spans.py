"""Host time of an engine step by phase (lowbit.engine.metrics.HostSpans) for the demo model
on the CPU, with the model's forward and logits stubbed out (zeros of the right shapes), so
that what is timed is the engine's own host work: scheduling, staging, launches of the
sampler / acceptance ops, the update. Plain decode, then n-gram speculation (k = 3) at
synthetic acceptance 0.7; each the best of three runs of 200 greedy tokens.

    python scripts/host_spans.py
"""

from __future__ import annotations

import torch

from lowbit.engine.llm import LLM
from lowbit.engine.sampling import SamplingParams


def run(spec: bool) -> tuple[int, dict[str, int], int]:
    kw = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_synthetic_accept=0.7) if spec else {}
    llm = LLM("demo", device="cpu", kv_cache_tokens=2048, **kw)
    eng = llm.engine
    model = eng.runner.model
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    model.forward = lambda ids, batch, *a, **k: torch.zeros(ids.shape[0], hidden)
    model.compute_logits = lambda h: torch.zeros(h.shape[0], vocab)
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    llm.generate(["hello there"], sp)  # warm
    eng.spans.reset(True)
    llm.generate(["hello there"], sp)
    per = eng.spans.per_step_us()
    return eng.spans.steps, {k: round(v) for k, v in per.items()}, round(sum(per.values()))


def main() -> None:
    for spec in (False, True):
        best = min((run(spec) for _ in range(3)), key=lambda r: r[2])
        steps, phases, total = best
        print(f"{'ngram k=3 synthetic 0.7' if spec else 'plain'}: {steps} steps, {total} us a step: "
              + ", ".join(f"{k} {v}" for k, v in phases.items()))


if __name__ == "__main__":
    main()
