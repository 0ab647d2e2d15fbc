"""lowbit/layers/moe.py: Experts call the moe op for every expert layout, gpt-oss extras on
hybrid stacks included (the op's torch route runs them; no Triton route takes them)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.errors import LowbitError  # noqa: E402
from lowbit.formats import get_format  # noqa: E402
from lowbit.formats.hybrid import HybridTensor  # noqa: E402
from lowbit.kernels import routes  # noqa: E402
from lowbit.kernels.moe import MoeActivation, reference_moe  # noqa: E402
from lowbit.kernels.weights import resolve  # noqa: E402
from lowbit.layers.moe import Experts  # noqa: E402

D, E, INTER, LIMIT = 64, 5, 64, 7.0
HOT = [3, 0]  # stack order need not follow the expert ids


def _hybrid(shape: tuple[int, ...], seed: int) -> HybridTensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.1
    cold = [e for e in range(shape[0]) if e not in HOT]
    parts = {"hot": get_format("nvfp4").quantize(w[HOT]), "cold": get_format("nf3").quantize(w[cold])}
    return HybridTensor(shape, parts, {"hot": HOT, "cold": cold})


def _oss_experts() -> Experts:
    ex = Experts(E, D, INTER, "model.layers.0.mlp.experts", bias=True, activation="swiglu_oai", limit=LIMIT)
    ex.set_quantized_weight("w13", _hybrid((E, 2 * INTER, D), 1))
    ex.set_quantized_weight("w2", _hybrid((E, D, INTER), 2))
    g = torch.Generator().manual_seed(3)
    ex.b13.data.copy_(torch.randn(E, 2 * INTER, generator=g) * 0.1)
    ex.b2.data.copy_(torch.randn(E, D, generator=g) * 0.1)
    return ex


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hybrid_stacks_with_gpt_oss_extras_run_the_torch_reference(monkeypatch, dtype):
    ex = _oss_experts()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, D, generator=g).to(dtype)
    ids = torch.randint(0, E, (7, 2), generator=g, dtype=torch.int32)
    w = torch.rand(7, 2, generator=g)
    monkeypatch.delenv("LOWBIT_ROUTE_MOE", raising=False)
    routes.reset_counters()
    y = ex(x, ids, w)
    assert y.dtype == dtype
    assert [c["route"] for c in routes.counters()["route_calls"] if c["op"] == "moe"] == ["torch"]
    dense13, dense2 = resolve(ex.w13.dequantize()), resolve(ex.w2.dequantize())
    ref = reference_moe(x.float(), ids, w, dense13, dense2, b13=ex.b13, b2=ex.b2,
                        activation=MoeActivation("swiglu_oai", LIMIT))
    torch.testing.assert_close(y.float(), ref.to(dtype).float(), rtol=1e-5, atol=1e-5)


def test_a_forced_triton_route_names_the_hybrid_extras(monkeypatch):
    ex = _oss_experts()
    x, ids, w = torch.randn(2, D), torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2)
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "triton_moe_grouped")
    with pytest.raises(LowbitError, match="hybrid stacks with expert biases"):
        ex(x, ids, w)
