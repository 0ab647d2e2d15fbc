"""SamplingState: rows written once per request, neutral scratch and released rows, lazy
penalty tensors, batch modes, and agreement with the per-step `penalize` path."""

import torch

from lowbit.engine.sampling import SampleMode, SamplingParams, SamplingState, penalize
from lowbit.kernels.sample_op import _penalized, sample_rows

V = 12


def _row(state: SamplingState, r: int) -> dict:
    names = [*SamplingState.FLOATS, "top_k", "seed"]
    return {n: getattr(state, n)[r].item() for n in names}


def test_rows_start_neutral_with_a_scratch_row():
    state = SamplingState(3, V, "cpu")
    assert state.scratch_row == 3 and state.temperature.shape == (4,) and state.counts is None
    assert state.top_k.dtype == torch.int32 and state.seed.dtype == torch.int64
    assert _row(state, 3) == {**SamplingState.FLOATS, "top_k": 0, "seed": 0}


def test_assign_writes_the_row_and_release_clears_it():
    state = SamplingState(3, V, "cpu")
    p = SamplingParams(temperature=0.7, top_k=-1, top_p=0.9, min_p=0.05, seed=2**64 - 1)
    state.assign(1, p, [1, 2], [])
    row = _row(state, 1)
    assert row["top_k"] == 0 and row["seed"] == -1  # 2^64 - 1 wraps to int64
    assert abs(row["temperature"] - 0.7) < 1e-7 and abs(row["top_p"] - 0.9) < 1e-7
    assert _row(state, 0) == _row(state, 3)  # other rows untouched
    state.assign(2, SamplingParams(top_k=5, seed=9), [], [], seed=77)
    assert state.top_k[2] == 5 and state.seed[2] == 77  # an explicit seed wins
    state.release(1)
    assert _row(state, 1) == _row(state, 3)


def test_unseeded_rows_get_different_seeds():
    state = SamplingState(2, V, "cpu")
    state.assign(0, SamplingParams(temperature=1.0), [], [])
    state.assign(1, SamplingParams(temperature=1.0), [], [])
    assert state.seed[0] != state.seed[1]


def test_penalty_tensors_appear_with_the_first_penalized_request():
    state = SamplingState(2, V, "cpu")
    state.assign(0, SamplingParams(), [1], [2])
    assert state.counts is None and state.snapshot() is None
    state.assign(1, SamplingParams(frequency_penalty=1.0), [4, 4, 5], [6, 6, 7])
    assert state.counts.shape == (3, V) and state.counts.dtype == torch.int32
    assert state.counts[1].tolist() == [0] * 6 + [2, 1] + [0] * 4
    assert torch.nonzero(state.prompt_mask[1]).flatten().tolist() == [4, 5]
    counts = state.counts
    state.assign(1, SamplingParams(frequency_penalty=1.0), [9], [3])  # resumed with other history
    assert state.counts is counts  # never replaced: graphs hold its address
    assert state.counts[1].tolist() == [0, 0, 0, 1] + [0] * 8
    assert torch.nonzero(state.prompt_mask[1]).flatten().tolist() == [9]


def test_snapshot_and_restore_undo_a_warm_up_step():
    state = SamplingState(1, V, "cpu", penalties=True)
    state.assign(0, SamplingParams(temperature=0, presence_penalty=0.5), [], [1])
    snap = state.snapshot()
    sample_rows(torch.randn(1, V), state, torch.tensor([0]), torch.tensor([0]), SampleMode(penalties=True))
    assert state.counts.sum() == 2
    state.restore(snap)
    assert state.counts.sum() == 1 and state.counts[0, 1] == 1


def test_mode_for_a_batch():
    state = SamplingState(1, V, "cpu")
    greedy, hot = SamplingParams(temperature=0, top_k=3), SamplingParams(temperature=0.8)
    assert state.mode_for([]) == SampleMode()
    assert state.mode_for([greedy]) == SampleMode()  # filters of greedy rows do nothing
    assert state.mode_for([greedy, hot]) == SampleMode(random=True)
    assert state.mode_for([SamplingParams(min_p=0.1)]) == SampleMode(random=True, filters=True)
    assert state.mode_for([SamplingParams(temperature=0, repetition_penalty=1.1)]) == SampleMode(penalties=True)


def test_state_penalties_equal_the_per_step_penalize():
    params = [SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, presence_penalty=-1.0, frequency_penalty=2.0)]
    history = [([4, 2, 3], [3, 3, 8]), ([4], [5]), ([0], [5, 5, 2])]
    state = SamplingState(3, V, "cpu")
    for r, (p, (prompt, out)) in enumerate(zip(params, history)):
        state.assign(r, p, prompt, out)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0)) * 3
    rows = torch.tensor([0, 1, 2])
    want = penalize(logits, params, history)
    assert torch.equal(_penalized(logits, state, rows), want)
    got = sample_rows(logits, state, rows, torch.zeros(3, dtype=torch.long), state.mode_for(params))
    assert torch.equal(got, want.argmax(-1))
    assert not torch.equal(got, logits.argmax(-1))  # the penalties change the choice
