"""The draft length (lowbit.engine.draft_length): the cost model's choice, and the engine
applying it from its own measurements (--speculative-adaptive), with a controlled clock and
controlled (synthetic) acceptance."""

import random

import pytest
import torch

from lowbit.engine.draft_length import (
    DECIDE_EVERY,
    EXPLORE_EVERY,
    DraftLength,
    choose_draft_length,
    expected_rates,
)
from lowbit.engine.sampling import SamplingParams
from lowbit.server.metrics import render


def test_cost_model_picks_the_most_tokens_per_second():
    verify = {1: 1.0, 2: 1.0, 4: 1.2, 8: 2.0}  # seconds per verify step of T tokens
    rates = expected_rates([0.8, 0.6, 0.4], verify, 0.0)
    assert rates[0] == 1.0 and rates[1] == pytest.approx(1.8) and rates[3] == pytest.approx(2.8 / 1.2)
    assert choose_draft_length([0.8, 0.6, 0.4], verify, 0.0) == 3
    assert choose_draft_length([0.8, 0.6, 0.4], verify, 0.5) == 1  # a costly draft: fewer
    assert choose_draft_length([0.05, 0.0], verify, 0.2) == 0  # not worth it at all


def simulate(dl: DraftLength, p: float, verify: dict[int, dict[int, float]], draft_s: float,
             steps: int, seed: int = 0) -> list[int]:
    """Steps of each batch size in `verify` ({B: {T: seconds}}) in turn, each draft accepted with
    probability p given the ones before; the k each step ran."""
    rng, ks = random.Random(seed), []
    for i in range(steps):
        b = list(verify)[i % len(verify)]
        k = dl.k_for(b)
        outcomes = [(k, next((j for j in range(k) if rng.random() >= p), k)) for _ in range(b)]
        dl.record_step(b, k, verify[b][k + 1] + k * draft_s, k * draft_s, outcomes)
        ks.append(k)
    return ks


@pytest.mark.parametrize("p,draft_s", [(0.8, 0.0), (0.8, 0.3), (0.5, 0.0), (0.0, 0.0)])
def test_converges_to_the_cost_models_choice_per_batch_bucket(p, draft_s):
    """Two batch sizes, one weight-bound (a verify step of 4 tokens costs little more than one)
    and one compute-bound (cost grows with T): each bucket settles on the k the cost model
    picks from the true rates and times, and keeps exploring the others."""
    verify = {1: {1: 1.0, 2: 1.02, 3: 1.05, 4: 1.08}, 64: {1: 1.0, 2: 1.6, 3: 2.2, 4: 2.8}}
    dl = DraftLength(3, drafting_costs=draft_s > 0)
    ks = simulate(dl, p, verify, draft_s, 2000)
    truth = [p ** (j + 1) for j in range(3)]
    for b, times in verify.items():
        want = choose_draft_length(truth, times, draft_s)
        assert dl.current()[b] == want, (b, dl.history)
        recent = ks[-400:][list(verify).index(b)::2]
        assert EXPLORE_EVERY - 2 <= len(recent) / sum(k != want for k in recent) <= EXPLORE_EVERY + 2
    assert {h["batch_bucket"] for h in dl.history} == {1, 64}
    if p == 0.0:
        assert dl.current() == {1: 0, 64: 0}
    if p == 0.8 and draft_s == 0.0:
        assert dl.current() == {1: 3, 64: 1}  # the two buckets differ


def test_a_drafters_catch_up_counts_against_k_0():
    """A draft as costly as the target, always right (the model drafting for itself): k drafts
    take k draft forwards (a catch-up over the new tokens, then k - 1 chained), and k = 0
    still takes the catch-up, timed as drafting. Taking it off t_v(1) would make k = 0 look
    twice as fast as it is and win; kept in, every k >= 1 beats it."""
    dl = DraftLength(3, drafting_costs=True)
    for _ in range(200):
        k = dl.k_for(1)
        draft_s = max(k, 1) * 1.0
        dl.record_step(1, k, 1.0 + 0.05 * k + draft_s, draft_s, [(k, k)])
    assert dl.current()[1] >= 1
    assert dl.inputs(dl.buckets[1])[1][1] == pytest.approx(2.0)


def test_warm_up_measures_every_draft_count_first():
    """8 sequences: 12 steps give every T 3 samples and 24 sequences asked for 3 drafts, so the
    13th step chooses. One sequence: 3 samples of each T are not enough acceptance yet."""
    flat = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}
    dl = DraftLength(3, drafting_costs=False)
    ks = simulate(dl, 0.9, {8: flat}, 0.0, 12)
    assert sorted(ks) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3] and dl.current() == {}
    dl.k_for(8)
    assert dl.current() == {8: 3} and dl.history == [{"step": 13, "batch_bucket": 8, "k": 3}]
    dl = DraftLength(3, drafting_costs=False)
    simulate(dl, 0.9, {1: flat}, 0.0, 13)
    assert dl.current() == {}
    simulate(dl, 0.9, {1: flat}, 0.0, 64)
    assert dl.current() == {1: 3}


class Clock:
    """A clock the test moves: each step of the engine costs what the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("p,verify,want", [
    (0.7, {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.9}, 2),
    (0.0, {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6}, 0)])
def test_engine_applies_the_cost_models_choice(make_engine, p, verify, want):
    """The engine with --speculative-adaptive, synthetic acceptance P and a clock under which
    a decode step over T tokens a sequence costs verify[T]: it settles on the k the cost model
    picks from the true inputs (2 for P = 0.7 with a 4-token step costing 1.9x; 0 when drafts
    are never accepted and the cost grows with T), the k it picks from its own measurements,
    and /metrics shows it. At k = 0 most steps carry no draft."""
    eng = make_engine(speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=True,
                      speculative_synthetic_accept=p, max_num_seqs=8)
    adapt = eng.spec.adapt
    adapt.clock = clock = Clock()
    g = torch.Generator().manual_seed(2)
    for _ in range(8):
        eng.add_request(torch.randint(0, 250, (8,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=230, ignore_eos=True))
    drafted = []
    for _ in range(2 * DECIDE_EVERY + 8):
        sched = eng.schedule()
        previous = eng.run(sched)
        sample = eng.spec.sample
        decode = sample is not None and sample.asked is not None
        clock.now += verify[sample.k + 1] if decode else 5.0
        eng.postprocess(previous)
        drafted.append(sample.k if decode else None)
    assert want == choose_draft_length([p, p * p, p ** 3], verify, 0.0)
    assert adapt.current() == {8: want} == {8: choose_draft_length(*adapt.inputs(adapt.buckets[8]))}
    assert adapt.buckets[8].verify_s() == pytest.approx(verify)  # every T measured
    assert f'lowbit:spec_decode_draft_length{{model_name="x",batch_bucket="8"}} {want}' in render(eng, "x")
    if want == 0:
        late = drafted[-DECIDE_EVERY:]
        assert late.count(0) >= DECIDE_EVERY * (1 - 1 / EXPLORE_EVERY) - 1
