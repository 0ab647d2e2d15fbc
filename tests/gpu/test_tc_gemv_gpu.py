"""The tensor-core nvfp4 GEMV (lowbit.kernels.tc_gemv) against its torch twin on a CUDA GPU:
real and odd shapes, every M to 16, split-K determinism, CUDA-graph replay, refusals.

The twin decodes the same exact weights (e2m1 * scale * alpha * g) and multiplies in float32;
the kernel's bf16 products are exact and only the float32 summation order differs (rel 1e-4
on float32 outputs).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lowbit.kernels.samples import random_lut_view
from lowbit.kernels.weights import resolve
from tests.kernels.cases import guarded, poisoned, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"
NVFP4 = dict(bits=4, table="e2m1", block_size=16, scale_kind="e4m3")


def _weight(n: int, k: int, seed: int, **kw):
    v = random_lut_view(n, k, seed=seed, device=DEV, **{**NVFP4, **kw})
    return resolve(dataclasses.replace(v, codes=guarded(v.codes), scales=guarded(v.scales),
                                       table=guarded(v.table), table_index=guarded(v.table_index)))


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("n,k,tables", [(4096, 4096, 1), (2048, 768, 2), (1030, 384, 3)])
def test_tc_gemv_matches_twin(n, k, tables):
    """tables > 1: per-row code tables, as merged projections (QKV, gate + up) have."""
    from lowbit.kernels.dequant_gemm import reference_linear
    from lowbit.kernels.tc_gemv import tc_gemv

    w = _weight(n, k, seed=n + k, tables=tables)
    bias = torch.randn(n, device=DEV)
    for m in (1, 2, 5, 8, 9, 16):
        x = _x(m, k, seed=m)
        for cfg in (None, dict(BN=64, BK=128, SPLIT=3), dict(BN=128, BK=256, SPLIT=1),
                    dict(BN=64, BK=128, SPLIT=3, RING=3), dict(BN=128, BK=256, SPLIT=1, RING=4),
                    dict(BN=64, BK=256, SPLIT=1, RING=2, num_warps=4),
                    # narrow programs: one warp (16 rows) or two (32), no split / split
                    dict(BN=16, BK=256, SPLIT=1, num_warps=1), dict(BN=32, BK=128, SPLIT=2, num_warps=2),
                    dict(BN=16, BK=256, SPLIT=1, num_warps=1, PREFETCH=2)):
            out = poisoned(m, n, dtype=torch.float32, device=DEV)
            tc_gemv(x, w, bias, config=cfg, out=out)
            assert rel_err(out, reference_linear(x.float(), w, bias)) < 1e-4, (n, k, m, cfg)
    y = tc_gemv(x, w)  # bf16 output: one rounding of the float32 result
    assert y.dtype == torch.bfloat16
    assert rel_err(y, reference_linear(x.float(), w)) < 1e-2


@pytest.mark.parametrize("ring", [0, 4])
def test_tc_gemv_split_k_is_deterministic(ring):
    """Split-K sums in split order, so repeats are bit-identical; the shared-memory ring (RING)
    changes where the bytes wait, not the sums: the same bits as registers."""
    from lowbit.kernels.tc_gemv import tc_gemv

    w = _weight(4096, 14336, seed=6)
    x = _x(3, 14336, seed=6)
    outs = []
    for _ in range(3):
        out = poisoned(3, 4096, dtype=torch.float32, device=DEV)
        tc_gemv(x, w, config=dict(BN=64, BK=256, SPLIT=7, RING=ring), out=out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    out = poisoned(3, 4096, dtype=torch.float32, device=DEV)
    tc_gemv(x, w, config=dict(BN=64, BK=256, SPLIT=7, RING=0 if ring else 3), out=out)
    assert torch.equal(out, outs[0])


def test_tc_gemv_graph_replay():
    from lowbit.kernels.dequant_gemm import reference_linear
    from lowbit.kernels.tc_gemv import tc_gemv

    w = _weight(2048, 4096, seed=9)
    x = _x(4, 4096, seed=1)
    y = torch.empty(4, 2048, device=DEV, dtype=torch.float32)
    tc_gemv(x, w, out=y)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tc_gemv(x, w, out=y)
    for seed in (2, 3):
        x.copy_(_x(4, 4096, seed=seed))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, reference_linear(x.float(), w)) < 1e-4, seed


def test_tc_gemv_refusals():
    from lowbit.kernels.tc_gemv import tc_gemv_refusal

    w = _weight(256, 512, seed=1)
    assert tc_gemv_refusal(_x(1, 512, 0), w) is None
    assert "M = 17" in tc_gemv_refusal(_x(17, 512, 0), w)
    assert "bf16" in tc_gemv_refusal(_x(1, 512, 0).half(), w)
    assert "multiple of 128" in tc_gemv_refusal(_x(1, 400, 0), _weight(256, 400, seed=1))
    int4 = resolve(random_lut_view(256, 512, bits=4, table="int", block_size=32, scale_kind="f16",
                                   device=DEV))
    assert "nvfp4 only" in tc_gemv_refusal(_x(1, 512, 0), int4)
