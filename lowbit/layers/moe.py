"""Sparse MoE block: router -> dispatch -> experts -> combine.

Shapes: T tokens, D hidden, E experts, A active experts per token (top-k), I expert width.
  logits = gate(x)                      # [T, E]
  ids, w = route(logits)                # [T, A] int32, [T, A] float32
  y = experts(x, ids, w)                # [T, D]  sum_a w[t,a] * expert_{ids[t,a]}(x[t])
Expert weights are stacked: w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I].
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.formats.base import QuantizedTensor
from lowbit.kernels.moe_layout import HybridTensor, shared_layout, with_shared_slots
from lowbit.kernels.moe_op import MoeActivation, moe_experts
from lowbit.kernels.router_op import RouterSpec, route
from lowbit.kernels.routes import forced_name
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
        gate, up = h.chunk(2, dim=-1)
        if self.activation == "silu":
            return nn.functional.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * 1.702) * (up + 1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        plain = self.b13 is None and self.b2 is None and self.activation == "silu"
        if plain:
            return moe_experts(x, ids, w, self.w13, self.w2, layer=self.prefix)
        if isinstance(self.w13, HybridTensor):  # hybrid layouts take no biases: moe_experts
            return self.reference(x, ids, w)
        act = MoeActivation(self.activation, self.limit or 0.0)
        return moe_experts(x, ids, w, self.w13, self.w2, b13=self.b13, b2=self.b2,
                               activation=act, layer=self.prefix)

    def reference(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():  # host sync: reference path only
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            h = nn.functional.linear(x[tok], _dense(self.w13, e, x.dtype), _bias(self.b13, e))
            y = nn.functional.linear(self.act(h), _dense(self.w2, e, x.dtype), _bias(self.b2, e))
            out.index_add_(0, tok, y.float() * w[tok, slot, None])
        return out.to(x.dtype)


def _dense(w, e: int, dtype: torch.dtype) -> torch.Tensor:
    we = w[e]
    return we.to(dtype) if isinstance(we, torch.Tensor) else we.dequantize(dtype)


def _bias(b, e: int):
    return None if b is None else b[e]


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
        # set by the engine: expert offload / routing record (lowbit.engine.expert_cache)
        self.expert_hook = None

    def _fused_shared(self, x: torch.Tensor):
        """The routed + shared layout when the fused kernels would run it (CUDA, or a forced
        moe route), every weight is LUT-quantized and the shared width is whole experts."""
        ex, sh = self.experts, self.shared_experts
        if sh is None or ex.b13 is not None or ex.activation != "silu":
            return None
        if not (x.is_cuda or forced_name("moe") not in (None, "torch")):
            return None
        weights = (ex.w13, ex.w2, sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight)
        key = tuple(id(w) for w in weights)
        cached = getattr(self, "_shared_layout", None)
        if cached is None or cached[0] != key:
            inter = ex.w13.shape[1] // 2
            n_shared = sh.gate_proj.out_features // inter
            layout = None
            if n_shared * inter == sh.gate_proj.out_features and not isinstance(ex.w13, nn.Parameter):
                layout = shared_layout(*weights, n_shared)
            cached = self._shared_layout = (key, layout)
        return cached[1]

    def prepare_for_serving(self) -> None:
        """Keep the gate in float32 from now on: the router GEMM reads it as it is."""
        g = self.gate
        self._gate32 = (g.weight.float(), None if g.bias is None else g.bias.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, D]
        g = self.gate
        w32, b32 = getattr(self, "_gate32", None) or (g.weight.float(), None if g.bias is None else g.bias.float())
        ids, w = route(x, w32, b32, self.spec, self.e_score_correction_bias, layer=f"{self.experts.prefix}.router")
        if self.expert_hook is not None:  # routed experts read through the device slot table
            y = self.expert_hook(self, x, ids, w)
            return y if self.shared_experts is None else y + self.shared_experts(x)
        layout = self._fused_shared(x)
        if layout is not None:  # shared experts as extra slots of weight 1 in the routed launch
            n_exp = self.experts.w13.shape[0]
            ids, w = with_shared_slots(ids, w, n_exp, layout.num_experts - n_exp)
            return moe_experts(x, ids, w, layout, None, layer=self.experts.prefix)
        y = self.experts(x, ids, w)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
