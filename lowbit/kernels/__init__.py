"""Kernels: dequantizing Triton kernels, their torch references, and the route registry.

The two entry points the model layers call (signatures are stable):

    linear(x, weight, bias=None, *, layer="") -> Tensor
        x [..., K] (bf16 / fp16 / fp32); weight [N, K] as a dense tensor, a float8_e4m3fn
        tensor, or a quantized tensor (duck-typed: anything with `lut_view()`, or a payload
        of float8_e4m3fn codes and scales); bias [N] or None. Returns x @ W^T + bias,
        shape [..., N], dtype x.dtype.

    moe_experts(x, topk_ids, topk_weights, w13, w2, *, b13=None, b2=None, activation=None,
                shared=None, layer="") -> Tensor
        x [T, H]; topk_ids [T, A] int32 and topk_weights [T, A] float32 on x's device;
        w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], each dense, fp8 or a
        stacked quantized tensor as above; optional expert biases b13 [E, 2I] (gate half,
        then up half) and b2 [E, H], float, on x's device; activation a MoeActivation
        (None: SiLU). Returns
        y[t] = sum_j topk_weights[t, j] * (W2_e act(Wg_e x[t] + bg_e, Wu_e x[t] + bu_e) + b2_e),
        e = topk_ids[t, j], shape [T, H], dtype x.dtype, where act(g, u) is SiLU(g) * u, or
        for MoeActivation("swiglu_oai", limit=L, alpha=1.702) (gpt-oss)
        min(g, L) * sigmoid(alpha min(g, L)) * (clamp(u, -L, L) + 1).
        Hybrid expert layouts take no biases and only SiLU (ValueError). shared: the
        block's shared gated MLP (lowbit.kernels.moe_layout.SharedMLP), added to y; a
        route decides whether it rides in the routed launch.

`layer` names the caller in the route counters. Which implementation runs is decided per
call by lowbit.kernels.routes (LOWBIT_ROUTE_LINEAR / LOWBIT_ROUTE_MOE force one; docs/ROUTES.md).
"""

from lowbit.kernels import (  # noqa: F401  register their ops
    attention_op,  # noqa: F401  registers the attention and kv_write ops
    norm_gate_op,
    norm_op,
    rope_attention_op,
    rope_op,
    router_op,
    sample_op,
)
from lowbit.kernels.linear_op import linear
from lowbit.kernels.moe_op import MoeActivation, moe_experts
from lowbit.kernels.routes import counters, format_table, route_table

__all__ = ["linear", "moe_experts", "MoeActivation", "route_table", "format_table", "counters"]
