"""The SparseMoE block with DeepSeek-style shared experts fused into the routed launch.

With the moe route forced to a Triton route (interpreter on the CPU), the block appends the
shared MLP as extra always-selected expert slots; its output must match the unfused block
(routed experts + a separate shared GatedMLP) on the same quantized weights.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.formats import get_format  # noqa: E402
from lowbit.kernels.runtime import interpreting  # noqa: E402
from lowbit.layers.moe import RouterSpec, SparseMoE  # noqa: E402
from tests.kernels.cases import rel_err  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")
D, E, INTER = 64, 6, 64  # INTER: whole nf3 blocks (64), so a shared width splits into experts


def _block(fmt: str, n_shared: int) -> SparseMoE:
    torch.manual_seed(0)
    moe = SparseMoE(D, E, INTER, RouterSpec(top_k=2), "model.layers.0.mlp", shared_inter=n_shared * INTER)
    f = get_format(fmt)
    moe.gate.weight.data.normal_(0, 0.5)
    for name in ("w13", "w2"):
        p = getattr(moe.experts, name)
        moe.experts.set_quantized_weight(name, f.quantize(torch.randn(p.shape) * 0.1))
    for lin in (moe.shared_experts.gate_proj, moe.shared_experts.up_proj, moe.shared_experts.down_proj):
        lin.set_quantized_weight(f.quantize(torch.randn(lin.weight.shape) * 0.1))
    return moe


@pytest.mark.parametrize("fmt,n_shared", [("nvfp4", 1), ("nf3", 2)])
def test_shared_experts_fused(monkeypatch, fmt, n_shared):
    moe = _block(fmt, n_shared)
    x = torch.randn(3, D)
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "torch")
    unfused = moe(x)  # the torch route: routed experts, then the shared MLP separately
    assert moe._fused_shared(x) is None
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "triton_fused_moe_decode")
    monkeypatch.setenv("LOWBIT_ROUTE_LINEAR", "torch")
    layout = moe._fused_shared(x)
    assert layout is not None and layout.num_experts == E + n_shared
    fused = moe(x)
    assert rel_err(fused, unfused) < 3e-2  # bf16 tensor-core operands vs float32 throughout
