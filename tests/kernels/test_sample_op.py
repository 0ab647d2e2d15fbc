"""The `sample` op: greedy and random rows, the counter-based noise, filters, penalties and
counts, with every parameter read from a SamplingState's device tensors.

Random draws are seeded, so every statistical bound here is checked against fixed numbers:
a failure is a change in the sampler, never bad luck.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.engine.sampling import SamplingParams, SamplingState  # noqa: E402
from lowbit.errors import LowbitError  # noqa: E402
from lowbit.kernels import routes  # noqa: E402
from lowbit.kernels.runtime import interpreting  # noqa: E402
from lowbit.kernels.sample_op import (  # noqa: E402
    GREEDY,
    SampleMode,
    apply_penalties,
    exponential_noise,
    filter_logits,
    mix64_,
    sample_rows,
)

RANDOM = SampleMode(random=True)
FILTERS = SampleMode(random=True, filters=True)
M64 = (1 << 64) - 1
CHI2_7DOF_P001 = 24.32  # chi-square quantile: 7 degrees of freedom, p = 0.001


def _splitmix_mix(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _state(rows: list[SamplingParams], vocab: int, penalties: bool = False,
           history: list[tuple[list[int], list[int]]] | None = None) -> SamplingState:
    state = SamplingState(max(len(rows), 1), vocab, "cpu", penalties=penalties)
    for r, params in enumerate(rows):
        prompt, out = history[r] if history else ([], [])
        state.assign(r, params, prompt, out)
    return state


def _sample(logits, state, rows, steps, mode) -> torch.Tensor:
    return sample_rows(logits, state, torch.tensor(rows), torch.tensor(steps), mode)


def _logits(B: int, V: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * scale


# -- the noise --------------------------------------------------------------------------------
def test_mix64_is_splitmix64_with_wrapping_int64():
    x = torch.randint(-(2**62), 2**62, (4096,), generator=torch.Generator().manual_seed(1)) * 3
    x[:4] = torch.tensor([0, -1, (1 << 63) - 1, -(1 << 63)])
    assert [v & M64 for v in mix64_(x.clone()).tolist()] == [_splitmix_mix(v) for v in x.tolist()]


def test_noise_is_pinned_to_the_documented_hash():
    seeds, steps, V = torch.tensor([7, -3]), torch.tensor([0, 123456789]), 5
    got = exponential_noise(seeds, steps, V)
    golden = 0x9E3779B97F4A7C15
    for b in range(2):
        key = _splitmix_mix(_splitmix_mix(seeds[b].item()) + steps[b].item() * golden)
        for v in range(V):
            k = _splitmix_mix(key + (v + 1) * golden) >> 40
            want = -torch.tensor((k + 0.5) / 2**24, dtype=torch.float32).log()
            assert got[b, v] == want


def test_noise_depends_on_seed_step_and_token_only():
    seeds, steps = torch.tensor([1, 2, 1, 1]), torch.tensor([0, 0, 1, 0])
    noise = exponential_noise(seeds, steps, 1000)
    assert torch.equal(noise[0], noise[3])
    assert torch.equal(noise[0], exponential_noise(seeds[:1], steps[:1], 1000)[0])
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert noise[0].unique().numel() > 990  # tokens of one row draw apart
    big = exponential_noise(torch.tensor([5]), torch.tensor([9]), 200_000)
    assert big.min() > 0 and torch.isfinite(big).all()
    assert abs(big.mean().item() - 1) < 0.01 and abs(big.var().item() - 1) < 0.03


# -- greedy and random rows -------------------------------------------------------------------
def test_greedy_is_argmax_in_every_mode():
    logits = _logits(3, 50)
    state = _state([SamplingParams(temperature=0)] * 3, 50)
    for mode in (GREEDY, RANDOM, FILTERS):
        tokens = _sample(logits, state, [0, 1, 2], [4, 4, 4], mode)
        assert tokens.dtype == torch.int64 and torch.equal(tokens, logits.argmax(-1))


def test_top_k_1_is_greedy_at_any_temperature():
    logits = _logits(4, 64, seed=2)
    state = _state([SamplingParams(temperature=t, top_k=1, seed=i) for i, t in enumerate((0.5, 1, 2, 50))], 64)
    for step in range(5):
        assert torch.equal(_sample(logits, state, [0, 1, 2, 3], [step] * 4, FILTERS), logits.argmax(-1))


def test_seeded_row_draws_the_same_whatever_the_batch():
    V = 300
    mine = SamplingParams(temperature=1.0, seed=42)
    state = _state([SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0), mine], V)
    row_logits = _logits(1, V, seed=3, scale=0.5)[0]
    alone = [_sample(row_logits[None], state, [2], [s], RANDOM).item() for s in range(20)]
    scratch = state.scratch_row
    for mode in (RANDOM, FILTERS):
        batch = _logits(4, V, seed=4, scale=0.5)
        batch[1] = row_logits
        got = [_sample(batch, state, [0, 2, scratch, scratch], [s + 7, s, 0, 0], mode)[1].item()
               for s in range(20)]
        assert got == alone
    assert len(set(alone)) > 5  # a flat distribution: the draws move


def test_different_seeds_and_steps_differ():
    V = 1000
    state = _state([SamplingParams(temperature=1.0, seed=s) for s in (1, 2)], V)
    logits = torch.zeros(2, V)
    draws = torch.stack([_sample(logits, state, [0, 1], [s, s], RANDOM) for s in range(8)])  # [8, 2]
    assert not torch.equal(draws[:, 0], draws[:, 1])
    assert draws[:, 0].unique().numel() > 4


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    seen = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    keep = expected > 0
    assert seen[~keep].sum() == 0, "a zero-probability token was drawn"
    return (((seen - expected) ** 2)[keep] / expected[keep]).sum().item()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_follow_the_softmax(temperature):
    V, n = 8, 4000
    logits = torch.tensor([1.5, 0.2, -0.4, 0.9, -1.0, 0.0, 0.4, -2.0])
    state = _state([SamplingParams(temperature=temperature, seed=11)], V)
    tokens = _sample(logits.expand(n, V), state, [0] * n, list(range(n)), RANDOM)
    probs = (logits / temperature).softmax(-1)
    assert _chi_square(tokens, probs) < CHI2_7DOF_P001
    assert _chi_square(tokens, torch.full((V,), 1 / V)) > 10 * CHI2_7DOF_P001  # the test can fail


def test_top_k_draws_follow_the_renormalized_top_k():
    V, n = 8, 4000
    logits = torch.tensor([1.5, 0.2, -0.4, 0.9, -1.0, 0.0, 0.4, -2.0])
    state = _state([SamplingParams(temperature=1.0, top_k=3, seed=12)], V)
    tokens = _sample(logits.expand(n, V), state, [0] * n, list(range(n)), FILTERS)
    top = torch.full((V,), float("-inf"))
    top[[0, 3, 6]] = logits[[0, 3, 6]]
    assert _chi_square(tokens, top.softmax(-1)) < CHI2_7DOF_P001


def test_top_p_and_min_p_never_emit_a_filtered_token():
    V, n = 40, 2000
    logits = _logits(1, V, seed=6)[0]
    probs = logits.softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    nucleus = set(order[(sorted_p.cumsum(0) - sorted_p) < 0.5].tolist())
    above = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    state = _state([SamplingParams(temperature=1.0, top_p=0.5, seed=1),
                    SamplingParams(temperature=1.0, min_p=0.2, seed=2)], V)
    tokens = _sample(logits.expand(2 * n, V), state, [0, 1] * n, [s // 2 for s in range(2 * n)], FILTERS)
    assert set(tokens[0::2].tolist()) == nucleus and len(nucleus) < V // 2
    assert set(tokens[1::2].tolist()) == above and len(above) < V // 2


def test_filters_off_is_the_plain_softmax():
    """top_p = 1 must keep the tail even where the float32 running sum reaches 1."""
    logits = torch.cat([torch.full((1,), 12.0), torch.randn(30_000, generator=torch.Generator().manual_seed(0))])
    one = torch.ones(1)
    got = filter_logits(logits[None], one, torch.zeros(1, dtype=torch.int32), one, torch.zeros(1))
    assert torch.equal(got[0], logits.softmax(-1))


# -- penalties and counts ---------------------------------------------------------------------
def test_penalties_follow_apply_penalties_and_counts_advance():
    V = 16
    logits = _logits(3, V, seed=8)
    top = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0, repetition_penalty=8.0),
              SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0),
              SamplingParams(temperature=0)]
    history = [([top[0], 3], []), ([], [top[1], top[1], 5]), ([], [])]
    state = _state(params, V, penalties=True, history=history)
    scratch = state.scratch_row
    before = state.counts.clone()
    rows = [0, 1, 2, scratch]
    padded = torch.cat([logits, logits[:1]])
    tokens = _sample(padded, state, rows, [0] * 4, SampleMode(penalties=True))
    idx = torch.tensor(rows)
    want = apply_penalties(padded, before[idx], state.prompt_mask[idx], state.repetition_penalty[idx],
                           state.presence_penalty[idx], state.frequency_penalty[idx]).argmax(-1)
    assert torch.equal(tokens, want)
    assert tokens[0] != top[0] and tokens[1] != top[1] and tokens[2] == top[2]  # the penalties bite
    added = torch.zeros_like(before)
    added[idx, tokens] = 1
    assert torch.equal(state.counts, before + added)
    _sample(padded, state, rows, [1] * 4, GREEDY)  # not penalties mode: counts stay
    assert torch.equal(state.counts, before + added)


def test_repeated_padding_rows_all_count():
    state = _state([SamplingParams(temperature=0, presence_penalty=1.0)], 8, penalties=True)
    s = state.scratch_row
    logits = torch.zeros(3, 8)
    logits[:, 5] = 1.0
    _sample(logits, state, [s, s, s], [0, 0, 0], SampleMode(penalties=True))
    assert state.counts[s, 5] == 3


# -- graph safety -----------------------------------------------------------------------------
def test_runs_on_meta_tensors_so_it_never_reads_values_on_the_host():
    """Meta tensors have no data: any .item(), .tolist() or host branch on a value raises."""
    state = SamplingState(4, 32, "meta", penalties=True)
    state.assign(0, SamplingParams(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.3), [1, 2], [3])
    logits = torch.empty(3, 32, device="meta")
    rows, steps = torch.tensor([0, 4, 4], device="meta"), torch.zeros(3, dtype=torch.long, device="meta")
    for mode in (GREEDY, RANDOM, FILTERS, SampleMode(True, True, True)):
        tokens = sample_rows(logits, state, rows, steps, mode)
        assert tokens.device.type == "meta" and tokens.shape == (3,) and tokens.dtype == torch.int64


def test_routes_and_modes():
    op = routes.ops()["sample"]
    assert op.names() == ["triton_race", "torch"]
    assert [r.status for r in op.routes] == [routes.OPT_IN, routes.DEFAULT]
    assert str(GREEDY) == "greedy" and str(SampleMode(True, False, True)) == "random+penalties"
    assert len({GREEDY, SampleMode(), RANDOM}) == 2  # modes key graphs: hashable, by value


# -- the Triton race route --------------------------------------------------------------------
needs_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")


def _both_routes(monkeypatch, logits, state, rows, steps, mode) -> tuple[list[int], list[int]]:
    monkeypatch.setenv("LOWBIT_ROUTE_SAMPLE", "torch")
    want = _sample(logits, state, rows, steps, mode).tolist()
    monkeypatch.setenv("LOWBIT_ROUTE_SAMPLE", "triton_race")
    return _sample(logits, state, rows, steps, mode).tolist(), want


@needs_interpreter
@pytest.mark.parametrize("B,V", [(1, 3000), (3, 1025), (8, 5000)])  # 3, 2 and 1 programs per row
def test_triton_race_draws_the_torch_route_tokens(monkeypatch, B, V):
    params = [SamplingParams(temperature=0.3 + 0.4 * i, seed=i, top_p=0.8 if i % 2 else 1.0,
                             top_k=0 if i % 3 else 40) for i in range(B)]
    state = _state(params, V)
    logits = _logits(B, V, seed=B)
    for mode in (RANDOM, FILTERS):
        for step in (0, 9):
            got, want = _both_routes(monkeypatch, logits, state, list(range(B)), [step] * B, mode)
            assert got == want


@needs_interpreter
def test_triton_race_is_the_same_alone_and_in_a_batch(monkeypatch):
    V = 2500
    state = _state([SamplingParams(temperature=2.0, seed=i) for i in range(6)], V)
    monkeypatch.setenv("LOWBIT_ROUTE_SAMPLE", "triton_race")
    logits = _logits(6, V, seed=1)
    batch = _sample(logits, state, list(range(6)), [3] * 6, RANDOM)
    alone = [_sample(logits[i:i + 1], state, [i], [3], RANDOM).item() for i in range(6)]
    assert batch.tolist() == alone and len(set(alone)) > 3


def test_forcing_triton_race_fails_closed_on_an_empty_batch(monkeypatch):
    monkeypatch.setenv("LOWBIT_ROUTE_SAMPLE", "triton_race")
    state = _state([SamplingParams(temperature=1.0)], 8)
    with pytest.raises(LowbitError, match="triton_race"):
        _sample(torch.zeros(0, 8), state, [], [], RANDOM)
