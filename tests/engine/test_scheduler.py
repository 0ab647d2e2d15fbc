import pytest

from lowbit.engine.request import RequestRejected
from lowbit.engine.sampling import SamplingParams
from tests.engine.helpers import run_all, tokens_of

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(40, 77)), list(range(5, 25)), [9, 8, 7]]


def greedy_tokens(engine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    ids = [engine.add_request(p, params).request_id for p in prompts]
    out = run_all(engine)
    return [tokens_of(out[i]) for i in ids]


def test_chunked_prefill_gives_the_unchunked_tokens(make_engine):
    whole = greedy_tokens(make_engine())
    chunked = make_engine(max_num_batched_tokens=7)
    steps = []
    for p in PROMPTS:
        chunked.add_request(p, GREEDY)
    while chunked.has_unfinished():
        sched = chunked.scheduler.schedule()
        steps.append(sched.num_tokens)
        chunked.update_from_output(sched, chunked.runner.execute(sched))
    assert max(steps) == 7  # the budget held and was used
    chunked2 = make_engine(max_num_batched_tokens=7)
    assert greedy_tokens(chunked2) == whole


def test_requests_that_can_never_fit_are_refused_up_front(make_engine):
    engine = make_engine(max_model_len=64, kv_cache_tokens=48, block_size=16)
    with pytest.raises(RequestRejected) as e:
        engine.add_request(list(range(64)), GREEDY)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(RequestRejected) as e:
        engine.add_request(list(range(30)), SamplingParams(max_tokens=40))
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(RequestRejected) as e:  # fits the context, not the 48-token pool
        engine.add_request(list(range(30)), SamplingParams(max_tokens=30))
    assert e.value.code == "kv_cache_too_small"
    with pytest.raises(RequestRejected):
        engine.add_request([], GREEDY)
    with pytest.raises(RequestRejected):
        engine.add_request([1, 10_000], GREEDY)
    assert not engine.has_unfinished()


def test_max_num_seqs_caps_the_running_batch_fifo(make_engine):
    engine = make_engine(max_num_seqs=2)
    ids = [engine.add_request([i + 1] * 5, GREEDY).request_id for i in range(3)]
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ids[:2]
    assert [r.request_id for r in engine.scheduler.waiting] == ids[2:]
    run_all(engine)
    assert engine.blocks.num_free_blocks == engine.blocks.num_total_blocks


def test_preemption_by_recompute_keeps_greedy_outputs(make_engine):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = [greedy_tokens(make_engine(), [p], params)[0] for p in PROMPTS]
    tight = make_engine(kv_cache_tokens=64, block_size=4)  # 16 blocks for ~120 tokens of work
    together = greedy_tokens(tight, PROMPTS, params)
    assert tight.scheduler.num_preemptions > 0
    assert together == alone
    assert tight.blocks.num_free_blocks == tight.blocks.num_total_blocks


def test_abort_frees_blocks_at_once(make_engine):
    engine = make_engine()
    rid = engine.add_request(list(range(50)), GREEDY).request_id
    engine.step()
    assert engine.blocks.num_free_blocks < engine.blocks.num_total_blocks
    engine.abort(rid)
    assert engine.blocks.num_free_blocks == engine.blocks.num_total_blocks
    out = run_all(engine)
    assert out[rid][-1].finish_reason == "abort"


def test_a_budget_smaller_than_the_batch_still_serves_everyone(make_engine):
    whole = greedy_tokens(make_engine())
    engine = make_engine(max_num_batched_tokens=2)
    assert engine.config.max_num_seqs == 2  # seats never outnumber the tokens of a step
    assert greedy_tokens(engine) == whole
