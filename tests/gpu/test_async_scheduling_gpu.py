"""Async scheduling with decode CUDA graphs: step N+1 is launched (its pending tokens filled
in on the device from step N's graph output) before the host reads step N, with no host
sync between the launch and that read (torch's sync debug mode set to "error" around whole
engine steps), and the tokens are those of the synchronous engine.

The comparisons keep both engines' batches identical (every request up front, finishing by
max_tokens, which the scheduler sees coming), so bf16 results match bit for bit; the CPU
tests (tests/engine/test_async_scheduling.py) cover arrivals, stops and aborts.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.engines import GPU_ONLY
from tests.gpu.test_decode_graph_gpu import SAMPLERS, _engine, _into_decode

pytestmark = GPU_ONLY


def _generate(engine, batch: int, sampler: dict, logprobs: int | None = None) -> list[tuple]:
    """`batch` requests up front, max_tokens 6..(6 + 3 * batch), run to the end: per request
    (tokens, log-probability token ids, log-probabilities)."""
    from lowbit import SamplingParams

    g = torch.Generator().manual_seed(batch)
    reqs = [engine.add_request(torch.randint(32, 127, (9 + 5 * i,), generator=g).tolist(),
                               SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, logprobs=logprobs, **sampler))
            for i in range(batch)]
    while engine.has_unfinished():
        engine.step()
    return [(r.output_token_ids, [lp.token_id for lp in r.logprobs], [lp.logprob for lp in r.logprobs])
            for r in reqs]


@pytest.mark.parametrize("batch", [1, 3, 20])
@pytest.mark.parametrize("sampler", ["greedy", "penalties"])
def test_async_tokens_equal_sync_tokens(moe_dir, batch, sampler):
    outs = {}
    for overlap in (False, True):
        engine = _engine(moe_dir, async_scheduling=overlap)
        assert engine.runner.graphs is not None, engine.runner.graphs_off
        outs[overlap] = _generate(engine, batch, SAMPLERS[sampler], logprobs=2)
        assert engine.runner.graphs.graphs and not engine.runner.graphs.eager
        assert engine.blocks.num_free_blocks == engine.blocks.num_total_blocks
    assert engine.num_overlapped_steps > 0 and not engine.sync_steps, engine.sync_steps
    for (tok_a, ids_a, lp_a), (tok_s, ids_s, lp_s) in zip(outs[True], outs[False]):
        assert tok_a == tok_s and ids_a == ids_s
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_s), rtol=0, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 3, 20])
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_async_steps_do_not_sync_between_launch_and_read(moe_dir, batch, sampler):
    """Each step launches the next decode graph while the one before is still unread (a
    token pending per request), reads that one back through its event, and never syncs."""
    from lowbit import SamplingParams

    engine = _engine(moe_dir)
    assert engine.async_off is None
    reqs = _into_decode(engine, batch, SamplingParams(max_tokens=40, ignore_eos=True, **SAMPLERS[sampler]))
    engine.step()  # captures this bucket and mode (the capture synchronizes by design)
    engine.step()
    before, overlapped = [r.num_tokens for r in reqs], engine.num_overlapped_steps
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):
            engine.step()
            assert all(r.num_pending_tokens == 1 for r in reqs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [r.num_tokens - b for r, b in zip(reqs, before)] == [6] * batch
    assert engine.num_overlapped_steps - overlapped == 6
    assert not engine.runner.graphs.eager, engine.runner.graphs.eager
