"""The `linear` op: y = x @ W^T + b through the route registry.

Shape legend: x [..., K] flattened to [M, K]; W [N, K] (dense, LUT view or fp8); y [..., N].
Routes, in selection order (see lowbit.kernels.routes; status and record in docs/ROUTES.md):
  dense              bf16 / fp16 / fp32 weights: F.linear (cuBLAS on CUDA)
  triton_tc_gemv     nvfp4 weights, M <= 16, bf16 activations: the weight decoded in
                     registers as the tensor cores' A operand (lowbit.kernels.tc_gemv)
  triton_lut_gemv    CUDA-core dequantizing GEMV of LUT weights, M <= 16 where the device's
                     tuned configs measured it faster than the gemm, else M <= 4 (M <= 16
                     when forced)
  triton_lut_dequant M >= DEQUANT_MIN_M (fp8: M > 4): the weight decoded to bf16 / fp16 in
                     one launch, then cuBLAS; a transient of N x K x 2 bytes (<= 256 MiB)
  triton_lut_gemm    tensor-core tiles with in-register decode, bf16/fp16 activations
  triton_fp8_w8a16   the gemv (M <= 4; forced: gemv to 16, gemm above) on fp8 weights
  triton_fp8_w8a8    fp8 x fp8 tensor-core GEMM with per-token activation scales (sm_89+)
  torch_scaled_mm    the same W8A8 product through torch._scaled_mm (per-row weight scales)
  triton_vq_gemv     vector codebook (vq2 / vq3 / vq4) GEMV, M <= 4 (M <= 16 forced); OPT_IN
  torch              reference: decode with the format's twin, float32 matmul (dense: F.linear)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from lowbit.formats.views import DenseWeight, Fp8View, LutWeight, VqWeight
from lowbit.kernels import launch, routes
from lowbit.kernels.dequant import lut_dequant_mm
from lowbit.kernels.dequant_gemm import (
    fmt_key,
    gemv_refusal,
    lut_gemm,
    lut_gemv,
    reference_linear,
)
from lowbit.kernels.fp8_gemm import fp8_w8a8, scaled_mm_refusal, scaled_mm_w8a8, w8a8_refusal
from lowbit.kernels.runtime import capability, fp8_refusal, triton_refusal
from lowbit.kernels.tc_gemv import tc_gemv, tc_gemv_refusal
from lowbit.kernels.vq_gemv import vq_gemv, vq_gemv_refusal
from lowbit.kernels.weights import Resolved, resolve

BENCH = "docs/BENCHMARKS.md#kernels"


@dataclass
class LinearCall:
    x: torch.Tensor  # [M, K]
    weight: Resolved
    bias: torch.Tensor | None
    out_shape: tuple[int, ...]
    forced: bool = False

    @property
    def m(self) -> int:
        return self.x.shape[0]


def _common_refusal(call: LinearCall, kinds: tuple[type, ...]) -> str | None:
    if not isinstance(call.weight, kinds):
        return f"weights are {type(call.weight).__name__}, this route reads {'/'.join(k.__name__ for k in kinds)}"
    if call.weight.lead != ():
        return "weight is stacked; linear takes [N, K]"
    reason = triton_refusal(call.x, call.forced)
    if reason is not None:
        return reason
    if call.x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations are {call.x.dtype}"
    if call.x.shape[1] > call.weight.kp:
        return f"x has {call.x.shape[1]} columns but the weight stores {call.weight.kp}"
    return fp8_refusal(call.x, call.weight)


AUTO_GEMV_MAX_M = 4  # measured faster than the torch route up to here (docs/ROUTES.md)


def _measured_refusal(call: LinearCall) -> str | None:
    """Unforced: the device's measured choice between gemv and gemm at this shape and M
    (lowbit/kernels/configs/<device>.json), else gemv up to AUTO_GEMV_MAX_M rows."""
    if call.forced:
        return None
    w = call.weight
    pick = launch.choice(fmt_key(w), w.n, w.kp, call.m)
    if pick == "gemm":
        return f"M = {call.m}: the gemm was measured faster at {w.n}x{w.kp} on this device"
    if pick is None and call.m > AUTO_GEMV_MAX_M:
        return f"M = {call.m} > {AUTO_GEMV_MAX_M}: not measured faster unless forced"
    return None


def _admit_gemv(kinds: tuple[type, ...]):
    def admit(call: LinearCall) -> str | None:
        if not isinstance(call.weight, kinds):
            return _common_refusal(call, kinds)
        return (_measured_refusal(call) or _common_refusal(call, kinds)
                or gemv_refusal(call.x, call.weight))

    return admit


def _admit_gemm(kinds: tuple[type, ...]):
    def admit(call: LinearCall) -> str | None:
        reason = _common_refusal(call, kinds)
        if reason is None and call.x.dtype == torch.float32:
            reason = "tl.dot reads bf16/fp16 activations, got float32"
        return reason

    return admit


DEQUANT_MIN_M = 128  # LUT weights: decode once + cuBLAS from here (docs/BENCHMARKS.md#kernels)
DEQUANT_MAX_BYTES = 256 << 20  # the transient bf16 weight


def _admit_dequant(call: LinearCall) -> str | None:
    reason = _common_refusal(call, (LutWeight, Fp8View))
    if reason is not None:
        return reason
    if call.x.dtype not in (torch.bfloat16, torch.float16):
        return f"the library GEMM reads bf16 / fp16 activations, got {call.x.dtype}"
    floor = AUTO_GEMV_MAX_M + 1 if isinstance(call.weight, Fp8View) else DEQUANT_MIN_M
    if call.m < floor and not call.forced:
        return f"M = {call.m} < {floor}: decoding inside the GEMM tiles reads less"
    size = call.weight.n * call.x.shape[1] * call.x.element_size()
    if size > DEQUANT_MAX_BYTES:
        return f"the decoded weight would take {size >> 20} MiB > {DEQUANT_MAX_BYTES >> 20} MiB"
    return None


def _admit_lut_gemv(call: LinearCall) -> str | None:
    return _admit_gemv((LutWeight,))(call)


def _run_gemv(call: LinearCall) -> torch.Tensor:
    return lut_gemv(call.x, call.weight, call.bias)


def _run_gemm(call: LinearCall) -> torch.Tensor:
    return lut_gemm(call.x, call.weight, call.bias)


def _run_fp8_w8a16(call: LinearCall) -> torch.Tensor:
    if call.m <= 16:
        return lut_gemv(call.x, call.weight, call.bias)
    return lut_gemm(call.x, call.weight, call.bias)


def _admit_fp8_w8a16(call: LinearCall) -> str | None:
    if not call.forced and call.m > AUTO_GEMV_MAX_M:
        return f"M = {call.m} > {AUTO_GEMV_MAX_M}: not measured faster unless forced"
    reason = _common_refusal(call, (Fp8View,))
    if reason is None and call.m > 16 and call.x.dtype == torch.float32:
        reason = "tl.dot reads bf16/fp16 activations, got float32"
    if reason is None and call.m <= 16:
        reason = gemv_refusal(call.x, call.weight)
    return reason


def _admit_w8a8(call: LinearCall) -> str | None:
    reason = _common_refusal(call, (Fp8View,))
    if reason is not None:
        return reason
    return w8a8_refusal(call.x, call.weight)


def _run_w8a8(call: LinearCall) -> torch.Tensor:
    return fp8_w8a8(call.x, call.weight, call.bias)


def _admit_dense(call: LinearCall) -> str | None:
    if not isinstance(call.weight, DenseWeight):
        return f"weights are {type(call.weight).__name__}, this route reads DenseWeight"
    return None if call.weight.lead == () else "weight is stacked; linear takes [N, K]"


def _run_dense(call: LinearCall) -> torch.Tensor:
    w, b = call.weight.w, call.bias
    return F.linear(call.x, w.to(call.x.dtype), None if b is None else b.to(call.x.dtype))


def _run_torch(call: LinearCall) -> torch.Tensor:
    w = call.weight
    if isinstance(w, DenseWeight):
        return F.linear(call.x, w.w.to(call.x.dtype), None if call.bias is None else call.bias.to(call.x.dtype))
    return reference_linear(call.x, w, call.bias)


routes.register("linear", routes.Route(
    "dense", routes.DEFAULT, "torch F.linear (cuBLAS on CUDA) on bf16 / fp16 / fp32 weights: the "
    "ceiling the quantized routes are measured against (docs/BENCHMARKS.md#kernels)",
    _admit_dense, _run_dense))
routes.register("linear", routes.Route(
    "triton_tc_gemv", routes.DEFAULT,
    BENCH + " (H200, nvfp4, the three linear shapes: 1.05-1.18x the CUDA-core gemv at M = 1, "
    "1.6-8.1x it and 1.3-3.2x triton_lut_gemm at M = 4-16)",
    lambda call: _common_refusal(call, (LutWeight,)) or tc_gemv_refusal(call.x, call.weight),
    lambda call: tc_gemv(call.x, call.weight, call.bias)))
routes.register("linear", routes.Route(
    "triton_lut_gemv", routes.DEFAULT,
    BENCH + " (M = 1: 8.0-38.0 us, M = 4: 14.1-87.2 us; the torch route's bound: 111 / 111 / 24 us)",
    _admit_lut_gemv, _run_gemv))
routes.register("linear", routes.Route(
    "triton_lut_dequant", routes.DEFAULT, BENCH + " (prefill linears, H200: 0.41-0.62x torch bf16 at "
    "M = 128-512 and 0.80-1.03x from M = 2048, against 0.23-0.49x for triton_lut_gemm)",
    _admit_dequant, lambda call: lut_dequant_mm(call.x, call.weight, call.bias)))
routes.register("linear", routes.Route(
    "triton_lut_gemm", routes.DEFAULT, BENCH + " (M = 16: 59-177 us; the torch route it replaces "
    "above M = 4 decodes every weight to float32 per call: docs/BENCHMARKS.md#decode-graph)",
    _admit_gemm((LutWeight,)), _run_gemm))
routes.register("linear", routes.Route(
    "triton_fp8_w8a16", routes.DEFAULT, BENCH + " (M = 1: 10.2-32.5 us, M = 4: 20.3-101.1 us)",
    _admit_fp8_w8a16, _run_fp8_w8a16))
routes.register("linear", routes.Route(
    "triton_fp8_w8a8", routes.MEASURED_NEGATIVE,
    "50-108 us at 14336x4096 / 4096x14336, M = 1-16: 0.29-0.62x torch bf16, 2.9-5.6x slower "
    "than torch._scaled_mm (docs/BENCHMARKS.md#kernels)", _admit_w8a8, _run_w8a8))
def _admit_vq_gemv(call: LinearCall) -> str | None:
    if not call.forced and call.m > AUTO_GEMV_MAX_M:
        return f"M = {call.m} > {AUTO_GEMV_MAX_M}: not measured faster unless forced"
    return _common_refusal(call, (VqWeight,)) or vq_gemv_refusal(call.x, call.weight, call.bias)


def _admit_scaled_mm(call: LinearCall) -> str | None:
    if not isinstance(call.weight, Fp8View) or call.weight.lead != ():
        return _common_refusal(call, (Fp8View,))
    if call.x.is_cuda and capability(call.x.device.index or 0) < (8, 9):
        return "fp8 GEMMs need compute capability 8.9+"
    return scaled_mm_refusal(call.x, call.weight)


routes.register("linear", routes.Route(
    "torch_scaled_mm", routes.OPT_IN, "row-wise _scaled_mm measured 43-48 us at M = 1-16 on "
    "4096x14336 (H200, docs/BENCHMARKS.md#kernels), 1.5x the fp8 gemv at M = 1; now tensor-wise "
    "_scaled_mm (17.2-19.3 us bare) + one scale epilogue, not yet measured; W8A8 numerics "
    "(per-token activation scales), as triton_fp8_w8a8", _admit_scaled_mm,
    lambda call: scaled_mm_w8a8(call.x, call.weight, call.bias)))
routes.register("linear", routes.Route(
    "triton_vq_gemv", routes.OPT_IN, "H100 (call series 7c30aaf-9cea5a0): the first packed form "
    "6.5-10.6x slower than nf4 at M = 1; the block kernel that replaced it (5.2-6.6 lane "
    "instructions a weight offline, from 25-30) is not yet timed (STAGES=vq); M <= 4, M <= 16 "
    "when forced", _admit_vq_gemv,
    lambda call: vq_gemv(call.x, call.weight, call.bias)))
routes.register("linear", routes.Route(
    "torch", routes.DEFAULT, "reference (admits every call)", lambda call: None, _run_torch),
    reference=True)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None, *, layer: str = "") -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T + bias, in x.dtype. See lowbit.kernels for the contract."""
    w = resolve(weight)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    call = LinearCall(x2, w, bias, (*x.shape[:-1], w.n))
    return routes.dispatch("linear", call, layer).reshape(call.out_shape)
