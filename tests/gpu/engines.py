"""Shared by the engine-level GPU tests: their marks and an engine on the small random
qwen3_moe of test_attention_gpu.py (the `moe_dir` fixture of tests/gpu/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.runtime import interpreting

GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET=1 is set: GPU tests run compiled kernels"),
]


def cuda_engine(path, **cfg):
    """An LLMEngine on the model at `path` (bf16 on CUDA, a 16,384-token KV cache) with the
    caller's EngineConfig fields on top."""
    from lowbit.config import EngineConfig
    from lowbit.engine.engine import LLMEngine

    base = dict(model=str(path), device="cuda", dtype="bfloat16", kv_cache_tokens=16384)
    return LLMEngine(EngineConfig(**{**base, **cfg}))


def finish_without_syncs(engine) -> None:
    """Step `engine` until it is idle under torch's sync debug mode set to error: any
    synchronizing call in a step raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def run_staggered(engine, prompts, params, stagger: int = 3) -> list[list[int]]:
    """Requests arrive `stagger` steps apart, so chunks run beside decodes (mixed steps);
    each request's output token ids."""
    reqs, pending = [], list(prompts)
    while pending or engine.has_unfinished():
        if pending:
            reqs.append(engine.add_request(pending.pop(0), params))
        for _ in range(stagger):
            if engine.has_unfinished():
                engine.step()
    return [r.output_token_ids for r in reqs]
