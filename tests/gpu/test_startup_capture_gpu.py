"""--cuda-graph-capture start on CUDA: the graphs exist before the first request, a run of
staggered prompts (chunks beside decodes) captures nothing new, and its tokens are those of
an engine that captured each shape at its first step.

The model is the small random qwen3_moe of tests/gpu/test_attention_gpu.py (8 experts, top-2).
"""

from __future__ import annotations

import pytest
import torch

from lowbit.engine.prefill_graphs import STARTUP_GRAPHS
from tests.gpu.engines import GPU_ONLY, cuda_engine, run_staggered

pytestmark = GPU_ONLY


def _engine(path, **kw):
    return cuda_engine(path, **{**dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=1024), **kw})


@pytest.mark.parametrize("sampler", [dict(temperature=0.0), dict(temperature=0.9, seed=7)])
def test_a_startup_capture_serves_a_run_with_the_lazy_engines_tokens(moe_dir, sampler):
    from lowbit import SamplingParams

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(32, 127, (int(torch.randint(5, 300, (1,), generator=g)),), generator=g).tolist()
               for _ in range(6)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, **sampler)
    lazy = _engine(moe_dir, cuda_graph_capture="lazy")
    assert not lazy.runner.graphs.graphs and lazy.startup_capture is None
    want = run_staggered(lazy, prompts, params)

    eager_start = _engine(moe_dir, cuda_graph_capture="start")
    r, cap = eager_start.runner, eager_start.startup_capture
    modes = eager_start.startup_modes()
    assert cap["skipped"] is None and cap["decode"] == len(r.graphs.buckets) * len(modes), cap
    assert cap["prefill"] == min(len(r.prefill_graphs.capture_order()) * len(modes), STARTUP_GRAPHS)
    assert not r.graphs.eager and not r.prefill_graphs.eager
    before = (set(r.graphs.graphs), set(r.prefill_graphs.graphs))
    mode = r.sampling.mode_for([params])
    if mode in modes:
        got = run_staggered(eager_start, prompts, params)
        assert (set(r.graphs.graphs), set(r.prefill_graphs.graphs)) == before  # nothing captured mid-run
        assert r.prefill_graphs.replays > 0
    else:  # a mode the start did not cover is captured at its first step, as before
        got = run_staggered(eager_start, prompts, params)
        assert set(r.graphs.graphs) > before[0]
    assert got == want
