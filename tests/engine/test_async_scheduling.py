"""Async scheduling (lowbit.engine.engine): step N+1 is scheduled and launched before the
host reads step N's tokens, and a client sees exactly what the synchronous engine gives:
the same tokens, text, finish reasons and log-probabilities, whatever arrives, stops or is
aborted on the way. Steps that cannot overlap say why."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from lowbit.config import EngineConfig
from lowbit.engine.engine import SYNC_PROMPT_LOGPROBS
from lowbit.engine.sampling import SamplingParams
from lowbit.engine.staging import Padding, StepInputs
from tests.engine.helpers import run_all, tokens_of

EOS = 95  # "_": frequent in the tiny model's output, so some requests end on it
STOP_TOKEN = 43  # "+"


def _requests(n: int, seed: int = 0) -> list[tuple[int, str, list[int], SamplingParams]]:
    """(arrival step, id, prompt, params): greedy and seeded sampling, filters, penalties,
    log-probabilities, EOS, stop tokens and stop strings, max_tokens from 1 to 24."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    out = []
    for i in range(n):
        prompt = torch.randint(32, 127, (rand(2, 45),), generator=g).tolist()
        kind, max_tokens = i % 5, 1 if i == 3 else rand(2, 25)
        if kind == 0:
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2)
        elif kind == 1:
            sp = SamplingParams(temperature=0.9, seed=i, max_tokens=max_tokens, repetition_penalty=1.3,
                                frequency_penalty=0.5, presence_penalty=0.3, stop=["hh", "$`"])
        elif kind == 2:
            sp = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=100 + i, max_tokens=max_tokens,
                                ignore_eos=True, logprobs=0)
        elif kind == 3:
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=[STOP_TOKEN],
                                frequency_penalty=1.0, ignore_eos=True)
        else:
            sp = SamplingParams(temperature=1.0, seed=7 * i, max_tokens=max_tokens, min_p=0.05, logprobs=3)
        out.append((rand(0, 30), f"r{i}", prompt, sp))
    return out


def _drive(engine, requests, aborts: dict[str, int]) -> dict[str, dict]:
    """Step until idle; before step k, add the requests arriving at k. A client aborts
    request r once it has received aborts[r] tokens (as a client that stops reading)."""
    out: dict[str, dict] = {}
    last = max(a for a, *_ in requests)
    k = 0
    while k <= last or engine.has_unfinished():
        for at, rid, prompt, params in requests:
            if at == k:
                engine.add_request(prompt, params, request_id=rid)
        for d in engine.step():
            o = out.setdefault(d.request_id, {"tokens": [], "text": "", "logprobs": [], "finish": None})
            assert o["finish"] is None, "nothing comes after a request's last delta"
            o["tokens"] += d.token_ids
            o["text"] += d.text
            o["logprobs"] += d.logprobs
            o["finish"] = d.finish_reason
        for rid, o in out.items():
            if o["finish"] is None and len(o["tokens"]) >= aborts.get(rid, 1 << 30):
                engine.abort(rid)
        k += 1
        assert k < 3000, "the engine did not finish"
    return out


def _assert_same(sync: dict[str, dict], overlapped: dict[str, dict]) -> None:
    assert sync.keys() == overlapped.keys()
    for rid, want in sync.items():
        got = overlapped[rid]
        assert (got["tokens"], got["text"], got["finish"]) == (want["tokens"], want["text"], want["finish"]), rid
        assert len(got["logprobs"]) == len(want["logprobs"]), rid
        for a, b in zip(got["logprobs"], want["logprobs"]):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top], rid
            # the batches differ (finished requests still ride one step), so float sums may too
            assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4), rid


def _assert_idle(engine) -> None:
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_total_blocks
    assert len(engine.runner.free_rows) == engine.config.max_num_seqs
    assert not engine.requests


def run_all_one(engine, prompt, params):
    rid = engine.add_request(prompt, params).request_id
    return run_all(engine)[rid]


def test_async_gives_the_synchronous_streams(make_engine):
    requests = _requests(30)
    aborts = {"r2": 1, "r4": 2, "r9": 5, "r17": 3, "r25": 8, "r27": 4}
    runs = {}
    for overlap in (False, True):
        engine = make_engine(max_num_seqs=6, max_num_batched_tokens=48, async_scheduling=overlap)
        engine.eos_ids = {EOS}
        runs[overlap] = (engine, _drive(engine, requests, aborts))
    (sync, want), (overlapped, got) = runs[False], runs[True]
    _assert_same(want, got)
    finishes = {o["finish"] for o in want.values()}
    assert finishes == {"stop", "length", "abort"}  # the scenario covers each way to end
    assert sum(o["finish"] == "abort" for o in want.values()) >= 3  # aborted mid-stream
    assert any(o["tokens"] and o["tokens"][-1] == EOS for o in want.values())
    assert any(o["tokens"] and o["tokens"][-1] == STOP_TOKEN for o in want.values())
    assert overlapped.num_overlapped_steps > 0 and not overlapped.sync_steps
    assert overlapped.async_off is None
    assert sync.num_overlapped_steps == 0 and set(sync.sync_steps) == {"--no-async-scheduling"}
    for engine in (sync, overlapped):
        _assert_idle(engine)


def test_async_gives_the_synchronous_tokens_under_preemption(make_engine):
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True, presence_penalty=1.0),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)]
    prompts = [list(range(40, 77)), list(range(5, 25)), [9, 8, 7]]
    outs = {}
    for overlap in (False, True):
        engine = make_engine(kv_cache_tokens=64, block_size=4, async_scheduling=overlap)  # ~120 tokens of work
        ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, params)]
        out = run_all(engine)
        outs[overlap] = [(tokens_of(out[i]), [lp.token_id for d in out[i] for lp in d.logprobs]) for i in ids]
        assert engine.scheduler.num_preemptions > 0
        _assert_idle(engine)
    assert outs[True] == outs[False]


def test_a_length_limit_costs_no_extra_step_and_a_stop_one_dropped_token(make_engine):
    """max_tokens is known from counts, so the scheduler stops at it; a stop token is only
    seen once read, so one more step was computed for it and its token dropped."""
    prompt = list(range(60, 70))
    free = tokens_of(run_all_one(make_engine(async_scheduling=False), prompt,
                                 SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    stop_at = next(i for i in range(3, 12) if free[i] not in free[:i])  # it stops there, not before
    for overlap in (False, True):
        engine = make_engine(async_scheduling=overlap)
        out = run_all_one(engine, prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        assert tokens_of(out) == free[:5] and out[-1].finish_reason == "length"
        steps = engine.num_overlapped_steps + sum(engine.sync_steps.values())
        assert steps == 5  # one prefill, four decodes
        engine = make_engine(async_scheduling=overlap)
        out = run_all_one(engine, prompt, SamplingParams(temperature=0, max_tokens=12,
                                                         stop_token_ids=[free[stop_at]]))
        assert tokens_of(out) == free[:stop_at + 1] and out[-1].finish_reason == "stop"
        steps = engine.num_overlapped_steps + sum(engine.sync_steps.values())
        assert steps == stop_at + 1 + overlap
        _assert_idle(engine)


def test_an_abort_drops_the_token_in_flight(make_engine):
    """Aborted after the client read m tokens, a request ends with those m in both engines:
    the async one drops the token its step in flight samples."""
    prompt = list(range(30, 50))
    for overlap in (False, True):
        engine = make_engine(async_scheduling=overlap)
        rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)).request_id
        deltas = []
        while len(tokens_of(deltas)) < 6:
            deltas += engine.step()
        assert engine.requests[rid].num_pending_tokens == overlap
        engine.abort(rid)
        assert engine.blocks.num_free_blocks == engine.blocks.num_total_blocks  # freed at once
        deltas += run_all(engine)[rid]
        assert deltas[-1].finish_reason == "abort" and len(tokens_of(deltas)) == 6
        _assert_idle(engine)


def test_prompt_logprobs_steps_run_synchronously(make_engine):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    prompt = list(range(40, 90))
    outs = {}
    for overlap in (False, True):
        engine = make_engine(max_num_batched_tokens=16, async_scheduling=overlap)
        out = run_all_one(engine, prompt, params)
        first = out[0].prompt_logprobs
        outs[overlap] = (tokens_of(out), [None if p is None else (p.token_id, round(p.logprob, 4)) for p in first])
        assert len(first) == len(prompt)
    assert outs[True] == outs[False]
    assert engine.sync_steps == {SYNC_PROMPT_LOGPROBS: 4}  # four prefill chunks of 16; decodes overlap
    assert engine.num_overlapped_steps == 5


@pytest.mark.parametrize("flags, why", [
    (dict(speculative_method="ngram"), "speculative decoding"),
    (dict(record_routing="/dev/null"), "--record-routing"),
    (dict(async_scheduling=False), "--no-async-scheduling"),
])
def test_engines_that_cannot_overlap_say_why(make_engine, flags, why):
    engine = make_engine(**flags)
    assert engine.async_off.startswith(why)
    out = run_all_one(engine, [40, 41, 42], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(tokens_of(out)) == 4
    assert engine.num_overlapped_steps == 0 and set(engine.sync_steps) == {engine.async_off}


def test_an_offloaded_engine_overlaps_its_steps_with_the_same_tokens(make_engine):
    """Expert offload: eager steps read their routing on the host, which only waits for the
    step in flight; decode steps overlap, and the tokens are the synchronous engine's."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = {}
    for overlap in (True, False):
        engine = make_engine(expert_offload=True, expert_cache_slots=2, async_scheduling=overlap)
        out[overlap] = tokens_of(run_all_one(engine, [40, 41, 42], sp))
        assert (engine.async_off is None) == overlap
        assert (engine.num_overlapped_steps > 0) == overlap
        assert engine.expert_cache.totals()["misses"] > 0
    assert out[True] == out[False] and len(out[True]) == 8


def test_pending_tokens_are_filled_in_on_the_device():
    inputs = StepInputs(8, 4, 2, Padding(0, 0, 4), torch.device("cpu"))
    values = {"input_ids": [5, 6, 0, 7, 0], "positions": [0, 1, 9, 3, 4], "slot_mapping": [0] * 5,
              "seq_lens": [2, 10, 5], "rows": [0, 1, 2], "steps": [2, 10, 5], "query_start": [0, 2, 3, 5],
              "last_index": [1, 2, 4], "sample_rows": [0, 1, 2], "picks": [0, 1, 2]}
    inputs.stage(values, [[1], [1], [1]], pending=[(2, 1), (4, 0)])
    inputs.upload()
    inputs.fill_pending(torch.tensor([11, 22, 33]))
    assert inputs.tokens()["input_ids"].tolist() == [5, 6, 22, 7, 11]


def test_sequence_fields_and_pending_pairs_go_up_as_one_buffer():
    """The sequence fields (two of them int32) and the pending pairs are typed views of one
    buffer on each side, so `upload` sends them in one copy; each keeps its own values, and
    a second, smaller step overwrites only what it stages."""
    inputs = StepInputs(8, 4, 2, Padding(0, 0, 4), torch.device("cpu"))
    small = inputs._small_dev.untyped_storage().data_ptr()
    span = range(small, small + inputs._small_dev.numel())
    for f in StepInputs.SEQ_FIELDS + StepInputs.PENDING:
        assert inputs.dev[f].data_ptr() in span and inputs.host[f].data_ptr() - inputs._small_host.data_ptr() \
            == inputs.dev[f].data_ptr() - small, f
        assert inputs.dev[f].data_ptr() % 8 == 0
    assert inputs.dev["seq_lens"].dtype == inputs.dev["query_start"].dtype == torch.int32
    values = {"input_ids": [5, 6, 7], "positions": [3, 4, 9], "slot_mapping": [1, 2, 3],
              "seq_lens": [4, 10], "rows": [2, 3], "steps": [4, 10], "query_start": [0, 2, 3],
              "last_index": [1, 2], "sample_rows": [2, 3], "picks": [0, 1]}
    inputs.stage(values, [[1], [1]], pending=[(1, 0)])
    inputs.upload()
    seqs = inputs.seqs()
    for f in StepInputs.SEQ_FIELDS:
        assert seqs[f].tolist() == values[f], f
    assert inputs.dev["pending_at"][:1].tolist() == [1] and inputs.dev["pending_src"][:1].tolist() == [0]
    values = {**{f: v[:1] for f, v in values.items()}, "query_start": [0, 1], "seq_lens": [7]}
    inputs.stage(values, [[1]])
    inputs.upload()
    assert inputs.seqs()["seq_lens"].tolist() == [7] and inputs.dev["seq_lens"][1].item() == 10
    assert inputs.seqs()["query_start"].tolist() == [0, 1] and inputs.dev["rows"][:2].tolist() == [2, 3]


def test_the_flag_is_on_by_default_and_named_as_vllm_names_it():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli(parser.parse_args([])).async_scheduling
    assert not EngineConfig.from_cli(parser.parse_args(["--no-async-scheduling"])).async_scheduling


def test_short_steps_send_their_tokens_in_the_small_buffer_and_long_ones_apart():
    """Up to `compact` tokens, a step's token fields are views into the one small buffer (one
    copy sends them with the sequence fields); a longer step uses the full-length fields.
    Steps alternate between the two and each reads back what it staged; pending tokens are
    filled into whichever the step uses."""
    inputs = StepInputs(400, 4, 2, Padding(0, 0, 4), torch.device("cpu"))
    assert inputs.compact == 256
    small = range(inputs._small_dev.data_ptr(), inputs._small_dev.data_ptr() + inputs._small_dev.numel())

    def step(n: int, pending=()):
        values = {"input_ids": [7 + i for i in range(n)], "positions": list(range(n)),
                  "slot_mapping": [3 * i for i in range(n)], "seq_lens": [n], "rows": [0], "steps": [n],
                  "query_start": [0, n], "last_index": [n - 1], "sample_rows": [0], "picks": [0]}
        inputs.stage(values, [[1]], pending=list(pending))
        inputs.upload()
        return values

    for n in (5, 300, 256, 257, 1, 300):
        values = step(n)
        tok = inputs.tokens()
        assert (tok["input_ids"].data_ptr() in small) == (n <= 256), n
        for f in StepInputs.TOKEN_FIELDS:
            assert tok[f].tolist() == values[f], (n, f)
        assert inputs.seqs()["seq_lens"].tolist() == [n]
    for n in (3, 290):
        step(n, pending=[(1, 2)])
        inputs.fill_pending(torch.tensor([40, 41, 42]))
        assert inputs.tokens()["input_ids"][:3].tolist() == [7, 42, 9], n
    with pytest.raises(AssertionError):
        step(4)
        inputs.tokens(300)  # more rows than a compact step has
