"""The `act` op (SiLU(gate) * up of a merged gate_up output): the Triton route against the
torch route (forced, on the Triton interpreter), on odd widths, rows of a wider buffer
between NaN guards, and NaN-poisoned outputs; and the refusals."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.kernels import act_op, routes  # noqa: E402
from lowbit.kernels.act_op import ActCall, _admit_triton, silu_mul  # noqa: E402
from lowbit.kernels.runtime import interpreting  # noqa: E402
from tests.kernels.cases import guarded, poisoned  # noqa: E402
from tests.kernels.test_norm_op import assert_ulp_close  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(act_op, "_empty", lambda shape, like: poisoned(*shape, dtype=like.dtype))


def _h(T: int, S: int, dtype, seed: int) -> torch.Tensor:
    """[T, 2S] rows of a [T, 2S + 3] buffer (a row stride that is not the width)."""
    g = torch.Generator().manual_seed(seed)
    buf = guarded((torch.randn(T, 2 * S + 3, generator=g) * 3).to(dtype))
    return buf[:, : 2 * S]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("S", [5, 37, 2816])  # 2816: DeepSeek-V2-Lite's two shared experts, 3 programs
def test_triton_matches_torch(monkeypatch, dtype, S):
    routes.reset_counters()
    for T in (1, 3, 17):
        h = _h(T, S, dtype, seed=T + S)
        monkeypatch.setenv("LOWBIT_ROUTE_ACT", "triton_silu_mul")
        got = silu_mul(h)
        monkeypatch.setenv("LOWBIT_ROUTE_ACT", "torch")
        want = silu_mul(h)
        assert got.shape == (T, S) and got.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert_ulp_close(got, want, max_frac=1e-2)
    ran = {(c["op"], c["route"]): c["count"] for c in routes.counters()["route_calls"]}
    assert ran == {("act", "triton_silu_mul"): 3, ("act", "torch"): 3}


def test_refusals():
    h = _h(2, 5, torch.bfloat16, seed=0)
    assert "TRITON_INTERPRET" in _admit_triton(ActCall(h))
    assert _admit_triton(ActCall(h, forced=True)) is None
    assert "[T, 2S]" in _admit_triton(ActCall(h[:, :9], forced=True))
    assert "int32" in _admit_triton(ActCall(torch.zeros(2, 4, dtype=torch.int32), forced=True))
