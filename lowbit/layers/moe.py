"""Sparse MoE block: router -> dispatch -> experts -> combine.

Shapes: T tokens, D hidden, E experts, A active experts per token (top-k), I expert width.
  logits = gate(x)                      # [T, E]
  ids, w = route(logits)                # [T, A] int32, [T, A] float32
  y = experts(x, ids, w)                # [T, D]  sum_a w[t,a] * expert_{ids[t,a]}(x[t])
Expert weights are stacked: w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I].
Shared experts (DeepSeek) go to the same moe op call as the routed ones; its routes decide
whether they ride in the routed launch (lowbit/kernels/moe_op.py).
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.formats.base import QuantizedTensor
from lowbit.kernels.moe import torch_act
from lowbit.kernels.moe_layout import SharedMLP
from lowbit.kernels.moe_op import MoeActivation, moe_experts
from lowbit.kernels.moe_slots import SlotSum
from lowbit.kernels.router_op import RouterSpec, route, route_topk
from lowbit.layers.linear import Linear, set_quantized
from lowbit.layers.loading import expert_loader
from lowbit.layers.mlp import GatedMLP


class Experts(nn.Module):
    """E stacked experts. activation: "silu" (SiLU(gate) * up) or "swiglu_oai" (gpt-oss:
    clamped gate/up, gate * sigmoid(1.702 gate) * (up + 1))."""

    def __init__(self, E: int, D: int, inter: int, prefix: str, bias: bool = False,
                 activation: str = "silu", limit: float | None = None) -> None:
        super().__init__()
        self.prefix, self.activation, self.limit = prefix, activation, limit
        self.w13 = nn.Parameter(torch.empty(E, 2 * inter, D), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, D, inter), requires_grad=False)
        self.b13 = nn.Parameter(torch.empty(E, 2 * inter), requires_grad=False) if bias else None
        self.b2 = nn.Parameter(torch.empty(E, D), requires_grad=False) if bias else None
        for p in (self.w13, self.w2, self.b13, self.b2):
            if p is not None:
                p.weight_loader = expert_loader

    def set_quantized_weight(self, name: str, qt: QuantizedTensor) -> None:
        """Hold the stack `name` ("w13" or "w2") in a format from now on."""
        assert name in ("w13", "w2"), name
        set_quantized(self, name, qt)

    def act(self, h: torch.Tensor) -> torch.Tensor:  # h [*, 2I] -> [*, I]
        return torch_act(h, self._activation())

    def _activation(self) -> MoeActivation | None:
        return None if self.activation == "silu" else MoeActivation(self.activation, self.limit or 0.0)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                shared: SharedMLP | None = None, defer: bool = False) -> torch.Tensor | SlotSum:
        return moe_experts(x, ids, w, self.w13, self.w2, b13=self.b13, b2=self.b2,
                           activation=self._activation(), shared=shared, defer=defer,
                           layer=self.prefix)


class SparseMoE(nn.Module):
    def __init__(self, D: int, E: int, inter: int, spec: RouterSpec, prefix: str, *,
                 gate_bias: bool = False, score_bias: bool = False, expert_bias: bool = False,
                 activation: str = "silu", limit: float | None = None,
                 shared_inter: int = 0) -> None:
        super().__init__()
        self.spec = spec
        self.gate = Linear(D, E, gate_bias, f"{prefix}.gate")
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(E), requires_grad=False) if score_bias else None
        )
        self.experts = Experts(E, D, inter, f"{prefix}.experts", expert_bias, activation, limit)
        self.shared_experts = GatedMLP(D, shared_inter, f"{prefix}.shared_experts") if shared_inter else None
        # what the moe op reads of them; it keeps the fused routed + shared layout
        self.shared = SharedMLP(self.shared_experts) if shared_inter else None
        # set by the engine: expert offload / routing record (lowbit.engine.expert_cache)
        self.expert_hook = None

    def prepare_for_serving(self) -> None:
        """Keep the gate in float32 from now on: the router GEMM reads it as it is."""
        g = self.gate
        self._gate32 = (g.weight.float(), None if g.bias is None else g.bias.float())

    def forward(self, x: torch.Tensor, defer_combine: bool = False,
                logits: torch.Tensor | None = None,
                routed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | SlotSum:
        """y [T, D] of x [T, D]; defer_combine: the fused MoE may return its slot rows unsummed
        (a SlotSum), for a caller whose next op is an RMSNorm (lowbit.kernels.norm_op).
        logits: the gate's float32 logits of x when the caller made them with the norm
        (lowbit.kernels.norm_gate_op); the router then only ranks them. routed: (ids, w), the
        router's choice made there too."""
        if routed is not None:
            ids, w = routed
        elif logits is not None:
            ids, w = route_topk(logits, self.spec, self.e_score_correction_bias,
                                layer=f"{self.experts.prefix}.router")
        else:
            g = self.gate
            w32, b32 = getattr(self, "_gate32", None) or (g.weight.float(), None if g.bias is None else g.bias.float())
            ids, w = route(x, w32, b32, self.spec, self.e_score_correction_bias, layer=f"{self.experts.prefix}.router")
        if self.expert_hook is not None:  # routed experts read through the device slot table
            y = self.expert_hook(self, x, ids, w)
            return y if self.shared_experts is None else y + self.shared_experts(x)
        return self.experts(x, ids, w, self.shared, defer=defer_combine)
