"""The `act` op: the gated activation of a dense gated MLP, SiLU(gate) * up, in one door.

Shape legend: T tokens, S intermediate width.
  silu_mul(h [T, 2S]) -> [T, S] in h's dtype: gate = h[:, :S], up = h[:, S:] (a merged
    gate_up projection's output), a = silu(gate) rounded to h's dtype, then a * up rounded
    (the two torch ops of F.silu(gate) * up, each rounding once)

Routes, in selection order:
  triton_silu_mul  (DEFAULT) one launch (grid T x ceil(S / BS));
                   graph-safe
  torch            reference: F.silu(gate) * up (two kernels; admits every call)

Kernel `_silu_mul_kernel`: program (t, j) reads BS gate and BS up values of row t (h rows
of unit element stride, any row stride), computes in float32, writes a fresh contiguous
[T, S]. silu(g) = g / (1 + exp(-g)), as torch computes it; the GPU's exp may differ from
torch's in the last float32 bit, which moves a bf16 result by at most one ulp, rarely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from lowbit.kernels import launch, routes
from lowbit.kernels.norm_op import DTYPE_CODE, FLOAT_DTYPES, round_to
from lowbit.kernels.pdl import pdl_enter
from lowbit.kernels.runtime import tl, triton, triton_refusal

# DEFAULT on its H100 record, taken with triton_mla_rope (the DeepSeek shared experts and dense MLPs)
RECORD = ("docs/BENCHMARKS.md#deepseek-mla-fused-routes-h100 (with triton_mla_rope: V2-Lite bf16 tg32 C1 "
          "223 -> 304 tok/s, 51.1 -> 18.1 kernels per layer, H100)")
BLOCK = 1024  # BS: columns per program


@dataclass
class ActCall:
    h: torch.Tensor  # [T, 2S]
    forced: bool = False


def _run_torch(call: ActCall) -> torch.Tensor:
    gate, up = call.h.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(h_ptr, y_ptr, S, stride_h, BS: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BS + tl.arange(0, BS)
    m = c < S
    g = tl.load(h_ptr + t * stride_h + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + t * stride_h + S + c, mask=m, other=0.0).to(tl.float32)
    a = round_to(tl.math.div_rn(g, 1.0 + tl.exp(-g)), DT)
    tl.store(y_ptr + t * S + c, round_to(a * u, DT), mask=m)


def _admit_triton(call: ActCall) -> str | None:
    h = call.h
    reason = triton_refusal(h, call.forced)
    if reason is not None:
        return reason
    if h.dtype not in FLOAT_DTYPES:
        return f"h is {h.dtype} (the kernel takes bf16, fp16 or float32)"
    if h.dim() != 2 or h.stride(-1) != 1 or h.shape[-1] % 2:
        return f"h {tuple(h.shape)} (strides {h.stride()}) is not [T, 2S] rows of unit stride"
    return None


def _empty(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A fresh output (uninitialised: the kernel writes every element; tests poison it)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _run_triton(call: ActCall) -> torch.Tensor:
    h = call.h
    T, S = h.shape[0], h.shape[1] // 2
    y = _empty((T, S), h)
    if T == 0 or S == 0:
        return y
    bs = min(BLOCK, triton.next_power_of_2(S))
    launch.run(_silu_mul_kernel, (T, triton.cdiv(S, bs)), h, y, S, h.stride(0), BS=bs, DT=DTYPE_CODE[h.dtype],
               num_warps=4 if bs >= 512 else 1, **launch.pdl_args(h))
    return y


routes.register("act", routes.Route("triton_silu_mul", routes.DEFAULT, RECORD, _admit_triton, _run_triton))
routes.register("act", routes.Route("torch", routes.DEFAULT, "reference (admits every call)",
                                    lambda call: None, _run_torch), reference=True)


def silu_mul(h: torch.Tensor, *, layer: str = "") -> torch.Tensor:
    """SiLU(h[:, :S]) * h[:, S:] for h [T, 2S] (module docstring), by the route the registry picks."""
    return routes.dispatch("act", ActCall(h), layer)
