import math
import time

import pytest
import torch

from lowbit.engine.sampling import SamplingParams
from tests.engine.helpers import run_all, text_of, tokens_of
from tests.engine.tiny_model import EOS_ID

PROMPT = list(range(60, 90))


def one(engine, prompt, params) -> list:
    rid = engine.add_request(prompt, params).request_id
    return run_all(engine)[rid]


def test_greedy_is_the_same_alone_and_inside_a_mixed_batch(make_engine):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = tokens_of(one(make_engine(), PROMPT, greedy))
    engine = make_engine(max_num_batched_tokens=40)
    others = [engine.add_request(list(range(n, n + 3 * n)), SamplingParams(seed=n, max_tokens=n))
              for n in (3, 9, 17)]
    engine.step()  # the others start first: ours joins a batch of prefill chunks and decodes
    rid = engine.add_request(PROMPT, greedy).request_id
    out = run_all(engine)
    assert tokens_of(out[rid]) == alone
    assert all(o.request_id in out for o in others)


def test_a_seed_fixes_the_sample_whatever_the_batch(make_engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = tokens_of(one(make_engine(), PROMPT, params))
    engine = make_engine()
    engine.add_request([5, 6, 7], SamplingParams(temperature=0.7, max_tokens=14))
    rid = engine.add_request(PROMPT, params).request_id
    assert tokens_of(run_all(engine)[rid]) == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=10, ignore_eos=True)
    assert tokens_of(one(make_engine(), PROMPT, other_seed)) != alone


def test_stop_string_cuts_the_text_and_deltas_add_up(make_engine):
    free = one(make_engine(), PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    text = text_of(free)
    stop = text[5:8]
    assert len(stop) == 3 and text.find(stop) == 5
    out = one(make_engine(), PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))
    assert text_of(out) == text[:5]
    assert out[-1].finish_reason == "stop"


def test_stop_token_ids_eos_and_length(make_engine):
    free = tokens_of(one(make_engine(), PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    out = one(make_engine(), PROMPT, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[free[3]]))
    assert tokens_of(out) == free[:free.index(free[3]) + 1] and out[-1].finish_reason == "stop"
    assert one(make_engine(), PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[-1].finish_reason == "length"
    engine = make_engine()
    engine.eos_ids = {free[2]}
    out = one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=8))
    assert out[-1].finish_reason == "stop" and tokens_of(out)[-1] == free[2]
    assert EOS_ID in make_engine().eos_ids


def test_frequency_penalty_breaks_repetition(make_engine):
    plain = tokens_of(one(make_engine(), [7] * 5, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)))
    assert len(set(plain)) < len(plain)  # the random model repeats itself greedily
    penal = tokens_of(one(make_engine(), [7] * 5, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                                    frequency_penalty=2.0, presence_penalty=2.0)))
    assert len(set(penal)) > len(set(plain))


def test_logprobs_are_the_model_distribution(make_engine):
    engine = make_engine()
    out = one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))
    lps = [lp for d in out for lp in d.logprobs]
    assert [lp.token_id for lp in lps] == tokens_of(out)
    for lp in lps:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy picks the top token
        assert math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-5)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert sum(math.exp(v) for _, v in lp.top) <= 1 + 1e-5


def test_prompt_logprobs_score_every_prompt_token_but_the_first(make_engine):
    engine = make_engine(max_num_batched_tokens=8)  # prompt logprobs across prefill chunks
    out = one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    plp = out[0].prompt_logprobs
    assert plp[0] is None and len(plp) == len(PROMPT)
    assert [p.token_id for p in plp[1:]] == PROMPT[1:]
    assert all(p.logprob <= 0 and len(p.top) == 2 for p in plp[1:])


def test_prefix_cache_hits_and_does_not_change_tokens(make_engine):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cold = make_engine(enable_prefix_caching=False)
    want = tokens_of(one(cold, PROMPT + [1], greedy))
    engine = make_engine()
    one(engine, PROMPT + [2], greedy)
    out = one(engine, PROMPT + [1], greedy)
    assert out[-1].num_cached_tokens == 16 and tokens_of(out) == want
    assert engine.blocks.num_free_blocks == engine.blocks.num_total_blocks


def test_kv_cache_dtypes_keep_the_greedy_tokens(make_engine):
    greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
    lps = lambda out: torch.tensor([lp.logprob for d in out for lp in d.logprobs])
    ref = one(make_engine(), PROMPT, greedy)
    bf16 = one(make_engine(kv_cache_dtype="bfloat16"), PROMPT, greedy)
    fp8 = one(make_engine(kv_cache_dtype="fp8"), PROMPT, greedy)
    assert tokens_of(fp8) == tokens_of(bf16) == tokens_of(ref)
    err_bf16 = (lps(bf16) - lps(ref)).abs().max()
    err_fp8 = (lps(fp8) - lps(ref)).abs().max()
    assert err_bf16 < 0.02 and err_fp8 < 0.5 and err_bf16 < err_fp8


def test_a_random_request_without_seed_still_runs(make_engine):
    out = one(make_engine(), [1, 2, 3], SamplingParams(temperature=0.8, top_k=5, min_p=0.1, max_tokens=5))
    assert 1 <= len(tokens_of(out)) <= 5
    assert torch.get_num_threads() == 1


def test_cpu_threads_auto_is_one_for_small_models_and_explicit_wins(make_engine):
    from types import SimpleNamespace

    import pytest

    from lowbit.engine.engine import cpu_threads
    from lowbit.errors import LowbitError

    small = SimpleNamespace(hidden_size=256, intermediate_size=768, moe_intermediate_size=192)
    large = SimpleNamespace(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cpu_threads(0, small) == 1
        assert cpu_threads(0, large) == 2  # torch's setting stands
        assert cpu_threads(3, small) == 3
        make_engine(cpu_threads=2)
        assert torch.get_num_threads() == 2
        make_engine()  # the tiny model: auto takes one thread
        assert torch.get_num_threads() == 1
        with pytest.raises(LowbitError, match="--cpu-threads"):
            make_engine(cpu_threads=-1)
    finally:
        torch.set_num_threads(before)


def test_max_tokens_left_out_runs_to_what_the_pool_holds(make_engine):
    import pytest

    from lowbit.engine.request import RequestRejected

    engine = make_engine(kv_cache_tokens=64)  # the model's context is 256 tokens
    out = one(engine, [5, 6, 7], SamplingParams(temperature=0, ignore_eos=True, max_tokens=None))
    assert len(tokens_of(out)) == 64 - 3
    assert engine.blocks.num_free_blocks == engine.blocks.num_total_blocks
    with pytest.raises(RequestRejected, match="kv_cache_too_small|pool holds 64"):
        engine.add_request(list(range(1, 70)), SamplingParams(max_tokens=None))


@pytest.mark.parametrize("spec", [False, True])
def test_host_spans_split_a_steps_wall_time_into_its_phases(make_engine, spec):
    """With the spans on, each step's host time lands in its phases (speculative steps add
    plan and propose); the phases add up to no more than the steps' wall-clock; off, nothing
    is recorded."""
    kw = dict(speculative_method="ngram", num_speculative_tokens=2, speculative_synthetic_accept=1.0) if spec else {}
    eng = make_engine(**kw)
    eng.add_request(list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    eng.step()  # the prompt
    eng.step()
    assert not eng.spans.total and eng.spans.steps == 0  # off by default
    eng.spans.reset(on=True)
    t0 = time.perf_counter()
    for _ in range(4):
        eng.step()
    wall = time.perf_counter() - t0
    host = eng.spans.per_step_us()
    want = {"schedule", "lists", "stage", "upload", "prepare", "launch", "read wait", "update"} | (
        {"plan", "propose", "logits", "accept", "follow"} if spec else set())
    assert want <= set(host), host
    assert all(v >= 0 for v in host.values()) and eng.spans.steps == 4
    assert sum(host.values()) * 4 <= wall * 1e6 * 1.001
    assert host["launch"] > 0 and host["prepare"] > 0 and host["stage"] > 0 and host["upload"] > 0
    eng.spans.reset(on=False)
    eng.step()
    assert not eng.spans.total
