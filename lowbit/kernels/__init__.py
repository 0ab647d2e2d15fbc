"""Kernels: dequantizing Triton kernels, their torch references, and the route registry.

The two entry points the model layers call (signatures are stable):

    linear(x, weight, bias=None, *, layer="") -> Tensor
        x [..., K] (bf16 / fp16 / fp32); weight [N, K] as a dense tensor, a float8_e4m3fn
        tensor, or a quantized tensor (duck-typed: anything with `lut_view()`, or a payload
        of float8_e4m3fn codes and scales); bias [N] or None. Returns x @ W^T + bias,
        shape [..., N], dtype x.dtype.

    moe_experts(x, topk_ids, topk_weights, w13, w2, *, layer="") -> Tensor
        x [T, H]; topk_ids [T, A] int32 and topk_weights [T, A] float32 on x's device;
        w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], each dense, fp8 or a
        stacked quantized tensor as above. Returns
        y[t] = sum_j topk_weights[t, j] * W2_e (SiLU(Wg_e x[t]) * (Wu_e x[t])), e = topk_ids[t, j],
        shape [T, H], dtype x.dtype.

`layer` names the caller in the route counters. Which implementation runs is decided per
call by lowbit.kernels.routes (LOWBIT_ROUTE_LINEAR / LOWBIT_ROUTE_MOE force one; docs/ROUTES.md).
"""

from lowbit.kernels import attention_op  # noqa: F401  registers the attention and kv_write ops
from lowbit.kernels.linear_op import linear
from lowbit.kernels.moe_op import moe_experts
from lowbit.kernels.routes import counters, format_table, route_table

__all__ = ["linear", "moe_experts", "route_table", "format_table", "counters"]
