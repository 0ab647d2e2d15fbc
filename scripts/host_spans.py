"""Host time of an engine step by phase (lowbit.engine.metrics.HostSpans) for the demo model
on the CPU, with the model's forward and logits stubbed out (zeros of the right shapes), so
that what is timed is the engine's own host work: scheduling, staging, launches of the
sampler / acceptance ops, the update. Plain decode, then n-gram speculation (k = 3) at
synthetic acceptance 0.7; each the best of three runs of 200 greedy tokens.
--context N: the speculative runs decode after a prompt of N random token ids (prompt
lookup at that depth), once with the drafter's n-gram index and once with the scan it
replaced (lowbit.engine.speculative.ngram_lookup over the whole context every step); the
stubbed logits are random there, so the tokens do not repeat (the scan's costly case).

    python scripts/host_spans.py [--context 32768]
"""

from __future__ import annotations

import argparse
import random

import torch

from lowbit.engine.llm import LLM
from lowbit.engine.sampling import SamplingParams
from lowbit.engine.speculative import NgramDrafter, ngram_lookup


def run(spec: bool, context: int = 0, scan: bool = False) -> tuple[int, dict[str, int], int]:
    kw = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_synthetic_accept=0.7) if spec else {}
    room = context + 256
    llm = LLM("demo", device="cpu", kv_cache_tokens=max(2048, room), **({"max_model_len": room} if context else {}), **kw)
    eng = llm.engine
    if scan:
        eng.runner.spec.drafter.plan = lambda req, k: ngram_lookup(req.token_ids, k)
    else:
        assert not spec or isinstance(eng.runner.spec.drafter, NgramDrafter)
    model = eng.runner.model
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    model.forward = lambda ids, batch, *a, **k: torch.zeros(ids.shape[0], hidden)
    if context:  # random tokens, as text without repeats: the prompt lookup's costly case
        gen = torch.Generator().manual_seed(0)
        model.compute_logits = lambda h: torch.randn(h.shape[0], vocab, generator=gen)
    else:
        model.compute_logits = lambda h: torch.zeros(h.shape[0], vocab)
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    vocab_ids = random.Random(0)
    prompt = [vocab_ids.randrange(vocab) for _ in range(context)] if context else "hello there"
    llm.generate(prompt, sp)  # warm
    eng.spans.reset(True)
    llm.generate(prompt, sp)
    per = eng.spans.per_step_us()
    return eng.spans.steps, {k: round(v) for k, v in per.items()}, round(sum(per.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=0, help="prompt length in random token ids (0: a short text)")
    args = ap.parse_args()
    arms = [("plain", False, False), ("ngram k=3 synthetic 0.7", True, False)]
    if args.context:
        arms.append(("the same, n-gram scan", True, True))
    for label, spec, scan in arms:
        best = min((run(spec, args.context, scan) for _ in range(3)), key=lambda r: r[2])
        steps, phases, total = best
        print(f"{label}{f' at {args.context} tokens' if args.context else ''}: {steps} steps, {total} us a step: "
              + ", ".join(f"{k} {v}" for k, v in phases.items()))


if __name__ == "__main__":
    main()
