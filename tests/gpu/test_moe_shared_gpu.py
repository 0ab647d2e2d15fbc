"""DeepSeek-V2-Lite's bf16 MoE block on the GPU: triton_moe_dense_shared's gemv launches with the
shared experts as extra slots, read in place from the merged gate_up and down weights (a
pointer offset from the routed stack), against the float32 reference of the routed experts
plus the shared MLP. Sizes: H = 2048, I = 1408, E = 64, top-6, 2 shared experts."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.runtime import interpreting

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET=1 is set: GPU tests run compiled kernels"),
]


@pytest.mark.parametrize("t", [1, 4, 15])
def test_shared_slots_in_the_gemv_at_v2_lite_sizes(t, monkeypatch):
    from lowbit.kernels import routes
    from lowbit.kernels.moe import reference_moe
    from lowbit.kernels.moe_layout import SharedMLP
    from lowbit.kernels.moe_op import moe_experts
    from lowbit.kernels.weights import resolve
    from lowbit.models.deepseek_v3 import GateUpMLP

    H, inter, E, A, n = 2048, 1408, 64, 6, 2
    g = torch.Generator(device="cuda").manual_seed(t)
    w13 = (torch.randn(E, 2 * inter, H, generator=g, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(E, H, inter, generator=g, device="cuda") * 0.02).bfloat16()
    mlp = GateUpMLP(H, n * inter, "shared").cuda().bfloat16()
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        lin.weight.data = (torch.randn(lin.weight.shape, generator=g, device="cuda") * 0.02).bfloat16()
    mlp.prepare_for_serving()
    x = torch.randn(t, H, generator=g, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:A] for _ in range(t)]).to(torch.int32)
    w = torch.rand(t, A, generator=g, device="cuda")
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "triton_moe_dense_shared")  # OPT_IN until its engine record
    routes.reset_counters()
    y = moe_experts(x, ids, w, w13, w2, shared=SharedMLP(mlp), layer="shared-gpu")
    calls = routes.counters()["route_calls"]
    assert [c["route"] for c in calls if c["op"] == "moe"] == ["triton_moe_dense_shared"]
    assert not [c for c in calls if c["op"] in ("linear", "act")]  # the shared MLP rode in the gemv
    gate, up = mlp.gate_up_proj.weight.float().chunk(2)
    shared = (torch.nn.functional.silu(x.float() @ gate.t()) * (x.float() @ up.t())) @ mlp.down_proj.weight.float().t()
    want = reference_moe(x.float(), ids, w, resolve(w13), resolve(w2)) + shared
    assert torch.isfinite(y).all()
    assert ((y.float() - want).norm() / want.norm()).item() < 1e-2
