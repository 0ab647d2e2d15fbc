"""The acceptance rule alone (lowbit.engine.acceptance), on small vocabularies where the exact
distributions are known: what it emits must follow the target, whatever the drafts."""

import pytest
import torch

from lowbit.engine.acceptance import accept, draft_tokens
from lowbit.engine.sampling import SamplingParams, SamplingState
from lowbit.kernels.sample_op import SampleMode, sample_rows

RANDOM = SampleMode(random=True)
FILTERS = SampleMode(random=True, filters=True)


def state_of(n: int, V: int, temperature: float = 1.0, top_p: float = 1.0, seed0: int = 0) -> SamplingState:
    """n rows, each with its own seed, the same parameters."""
    st = SamplingState(n, V, "cpu")
    st.temperature[:n] = temperature
    st.top_p[:n] = top_p
    st.seed[:n] = torch.arange(seed0, seed0 + n)
    return st


def chi2_sf(stat: float, df: int) -> float:
    """P(chi-square with df degrees of freedom > stat)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def goodness(samples: torch.Tensor, p: torch.Tensor) -> float:
    """p-value of a chi-square goodness-of-fit test of integer samples against p."""
    n = samples.numel()
    obs = torch.bincount(samples, minlength=p.numel()).double()
    keep = p > 0
    if obs[~keep].sum() > 0:
        return 0.0  # a token of probability 0 was emitted
    exp = n * p[keep].double()
    return chi2_sf(float(((obs[keep] - exp) ** 2 / exp).sum()), int(keep.sum()) - 1)


def test_point_mass_drafts_reproduce_the_samplers_own_tokens():
    """With n-gram drafts, what is emitted is exactly what a decode step would have drawn."""
    B, V = 64, 11
    st = state_of(B, V)
    logits = torch.randn(B, 3, V, generator=torch.Generator().manual_seed(0))
    rows, steps = torch.arange(B), torch.full((B,), 7)
    own = sample_rows(logits[:, 0], st, rows, steps, RANDOM)
    drafts = torch.stack([own, sample_rows(logits[:, 1], st, rows, steps + 1, RANDOM)], 1)
    drafts[::2, 1] = (drafts[::2, 1] + 1) % V  # every other row: the second draft is wrong
    tokens, n = accept(logits, drafts, torch.full((B,), 2), st, rows, steps, RANDOM)
    assert n[1::2].tolist() == [2] * (B // 2) and n[::2].tolist() == [1] * (B // 2)
    assert torch.equal(tokens[:, 0], own)
    second = sample_rows(logits[:, 1], st, rows, steps + 1, RANDOM)
    assert torch.equal(tokens[::2, 1], second[::2])  # the correction is the step's own draw
    third = sample_rows(logits[:, 2], st, rows, steps + 2, RANDOM)
    assert torch.equal(tokens[1::2, 2], third[1::2])  # the bonus token


def test_greedy_accepts_the_longest_matching_prefix():
    logits = torch.tensor([[[0., 5, 1], [4, 0, 1], [0, 0, 9]]])  # argmaxes 1, 0, 2
    st = state_of(1, 3, temperature=0.0)
    for drafts, want_n, want in (([1, 0], 2, [1, 0, 2]), ([1, 2], 1, [1, 0]), ([2, 0], 0, [1])):
        tokens, n = accept(logits, torch.tensor([drafts]), torch.tensor([2]), st, torch.tensor([0]),
                           torch.tensor([3]), SampleMode())
        assert int(n) == want_n and tokens[0, :want_n + 1].tolist() == want
    tokens, n = accept(logits, torch.tensor([[1, 0]]), torch.tensor([1]), st, torch.tensor([0]),
                       torch.tensor([3]), SampleMode())
    assert int(n) == 1 and tokens[0, :2].tolist() == [1, 0]  # one draft only: then the target's token


@pytest.mark.parametrize("mode,top_p", [(RANDOM, 1.0), (FILTERS, 0.8)])
def test_sampled_drafts_keep_the_target_distribution(mode, top_p):
    """Drafts drawn from q (far from p): the first emitted token follows p, the second (after an
    accepted first draft) follows p at position 1, and the acceptance rate is sum(min(p, q)).
    False-failure rate: each p-value bound is 1e-6, two per case, four cases: under 1e-5."""
    B, V = 40_000, 6
    g = torch.Generator().manual_seed(1)
    target = torch.randn(2 + 1, V, generator=g) * 1.5
    draft = torch.randn(2, V, generator=g) * 1.5
    st = state_of(B, V, top_p=top_p)
    rows, steps = torch.arange(B), torch.full((B,), 5)
    d_logits = draft[None].expand(B, 2, V).reshape(2 * B, V)
    d, q = draft_tokens(d_logits, st, rows.repeat_interleave(2), (steps[:, None] + torch.arange(2)).view(-1), mode)
    d, q = d.view(B, 2), q.view(B, 2, V)
    logits = target[None].expand(B, 3, V).contiguous()
    tokens, n = accept(logits, d, torch.full((B,), 2), st, rows, steps, mode, draft_probs=q)
    p = [_filtered(target[j], top_p) for j in range(2)]
    assert goodness(tokens[:, 0], p[0]) > 1e-6
    assert goodness(tokens[n >= 1, 1], p[1]) > 1e-6
    expected = float(torch.minimum(p[0], q[0, 0]).sum())
    assert abs(float((n >= 1).float().mean()) - expected) < 5 * (expected * (1 - expected) / B) ** 0.5
    # power: the draft's own tokens are far from p, and the same test rejects them
    assert goodness(d[:, 0], p[0]) < 1e-6


def _filtered(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    probs = logits.softmax(-1)
    if top_p >= 1:
        return probs
    sp, order = probs.sort(descending=True)
    drop = (sp.cumsum(-1) - sp) >= top_p
    sp[drop] = 0
    return torch.zeros_like(probs).scatter_(0, order, sp / sp.sum())


def test_penalties_count_the_drafts_before_each_position():
    """A presence penalty at position 1 sees draft 0; emitted tokens are counted once each."""
    V = 4
    st = SamplingState(1, V, "cpu", penalties=True)
    st.assign(0, SamplingParams(temperature=0, presence_penalty=2.0), [3], [])
    logits = torch.tensor([[[0., 5, 4, 0], [0, 5, 4, 0], [0, 5, 4, 0]]])  # 5 - 2 < 4
    tokens, n = accept(logits, torch.tensor([[1, 1]]), torch.tensor([2]), st, torch.tensor([0]),
                       torch.tensor([1]), SampleMode(penalties=True))
    assert int(n) == 1 and tokens[0, :2].tolist() == [1, 2]  # token 1 is penalized after draft 0
    assert st.counts[0].tolist() == [0, 1, 1, 0]


@pytest.mark.parametrize("drafted_on_device", [False, True])
def test_greedy_rule_on_the_host_is_the_device_rule(drafted_on_device):
    """A greedy verify step without penalties or sampled drafts reads the target's argmax and
    compares on the host (SpecDecoder._accept_on_host); it emits what accept() emits, for
    host drafts (n-gram) and a model drafter's device drafts, with ragged draft counts."""
    from lowbit.engine.speculative import NgramDrafter, SpecDecoder

    P, K, V = 24, 4, 7
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(P, K + 1, V, generator=g)
    ks = torch.randint(0, K + 1, (P,), generator=g).tolist()
    best = logits.argmax(-1)
    drafts = torch.where(torch.rand(P, K, generator=g) < 0.6, best[:, :K], torch.randint(0, V, (P, K), generator=g))
    for b, k in enumerate(ks):
        drafts[b, k:] = 0  # padding past a row's drafts
    st = state_of(P, V, temperature=0.0)
    tokens, n = accept(logits, drafts, torch.tensor(ks), st, torch.arange(P), torch.zeros(P, dtype=torch.long),
                       SampleMode())
    want = [[n[b].item()] + tokens[b, :n[b] + 1].tolist() for b in range(P)]
    spec = SpecDecoder("ngram", K, NgramDrafter(), 4096)
    listed = drafts.view(-1).tolist()
    if drafted_on_device:  # the drafter's flat tokens; the rule reads them back beside the argmax
        spec.drafted = (drafts.view(-1), {})
        listed = [-1] * len(listed)  # placeholders: the host list must not be what is compared
    assert spec._accept_on_host(best.view(-1), drafts.view(-1), listed, ks, K) == want
    assert any(w[0] > 0 for w in want) and any(w[0] < k for w, k in zip(want, ks))
    # a verify graph's argmax of every row of the step (rows shuffled among 3 * P * (K + 1)
    # others), the verify rows picked on the host by their indices
    step = torch.randint(0, V, (3 * P * (K + 1),), generator=g)
    rows_of = torch.randperm(step.shape[0], generator=g)[:P * (K + 1)]
    step[rows_of] = best.view(-1)
    assert spec._accept_on_host(step, drafts.view(-1), listed, ks, K, rows_of=rows_of.tolist()) == want
