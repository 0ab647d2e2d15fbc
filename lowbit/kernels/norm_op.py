"""The `norm` op: RMSNorm with an optional fused residual add, through the route registry.

Shape legend: T rows (tokens, or tokens x heads for per-head norms), D normed width.
  rms_norm(x [..., D], weight [D], eps, residual [..., D] | None) -> (y [..., D], r [..., D])
    r = x if residual is None else x + residual           (rounded to x.dtype)
    y = weight * (r32 * rsqrt(mean(r32 ** 2) + eps)).to(x.dtype),  r32 = r.float()
  y's dtype is torch's promotion of (weight, x): x.dtype when weight is in x.dtype.
  This is the HF reference models' convention, bit for bit in the torch route.

Routes, in selection order:
  triton_rmsnorm  one launch: one program per row, x and residual read once, y and r written
                  once (no r write without a residual: r is x itself); graph-safe. x may
                  be a fused MoE's slot rows (moe_slots.SlotSum): the program sums the
                  row's named slots in slot order and rounds once (the combine launch's
                  result, bit for bit), adds its extra (shared experts) and rounds again,
                  then goes on as above; r is then always written
  torch           reference: the expression above (8 torch ops; admits every call); a
                  SlotSum is summed first by its twin (moe_slots.reference_slot_sum)

Kernel `_rms_norm_kernel`, grid (T,). Memory layout: x, residual [T, D] with any row stride
and unit element stride (leading dims of [..., D] must merge into one strided row index,
as x.view(-1, D) requires); weight [D] contiguous; y, r written to fresh contiguous [T, D].
Invariant: a row fits one block (D <= MAX_D, padded to a power of two, masked lanes read 0),
so the mean of squares is one in-register reduction. Every rounding of the torch expression
is reproduced in float32: sum rounded to x.dtype, normed value rounded to x.dtype, product
with weight rounded to y's dtype. bf16 rounding is done on the bits (round to nearest even)
because Triton's interpreter truncates float32 -> bf16; the GPU gives the same bits.
Results equal the torch route's except where the fp32 sum of squares, summed in another
order, moves the normed value across a rounding boundary (rarely; the output then moves by
one or two units in the last place).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.kernels import launch, routes
from lowbit.kernels.moe_slots import SlotSum, reference_slot_sum
from lowbit.kernels.pdl import pdl_enter
from lowbit.kernels.runtime import tl, triton, triton_refusal

RECORD = "docs/BENCHMARKS.md#decode-graph"
MAX_D = 16384
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the kernels' DT constants (round_to); float8_e4m3fn only for KV-cache codes (rope_op)
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}


@dataclass
class NormCall:
    x: torch.Tensor  # [..., D]
    weight: torch.Tensor  # [D]
    eps: float
    residual: torch.Tensor | None = None  # [..., D] in x.dtype
    forced: bool = False
    slots: SlotSum | None = None  # x is this MoE output's sum (x: its out, not yet written)


# -- torch reference ---------------------------------------------------------------------------
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype) over the last dim (the HF convention)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _run_torch(call: NormCall) -> tuple[torch.Tensor, torch.Tensor]:
    x = call.x if call.slots is None else call.x.copy_(reference_slot_sum(call.slots))
    r = x if call.residual is None else x + call.residual
    return rms_norm_reference(r, call.weight, call.eps), r


# -- Triton --------------------------------------------------------------------------------------
@triton.jit
def round_to(x, DT: tl.constexpr):
    """float32 x rounded to nearest even in DT (DTYPE_CODE: 0 float32, 1 bf16, 2 fp16,
    3 float8_e4m3fn for |x| <= 448), kept as float32. bf16 and e4m3 round on the bits: the
    Triton interpreter truncates those casts, the GPU rounds; both then store these values
    exactly."""
    y = x
    if DT == 1:
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        y = tl.where(x != x, x, b.to(tl.float32, bitcast=True))  # NaN stays NaN
    elif DT == 2:
        y = x.to(tl.float16).to(tl.float32)
    elif DT == 3:
        bits = x.to(tl.uint32, bitcast=True)
        b = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) << 20  # 3 mantissa bits
        # below e4m3's smallest normal (2^-6) its step is 2^-9: adding 1.5 * 2^14 rounds to it;
        # the sign goes back on the bits (-tiny rounds to -0, as torch's cast)
        magnitude = ((tl.abs(x) + 24576.0) - 24576.0).to(tl.uint32, bitcast=True)
        subnormal = (magnitude | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
        y = tl.where(tl.abs(x) < 0.015625, subnormal, b.to(tl.float32, bitcast=True))
    return y


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, r_ptr, ys_ptr, ids_ptr, ex_ptr, D, d_float,
                     stride_x, stride_res, eps, E, A: tl.constexpr, BLOCK_D: tl.constexpr, XDT: tl.constexpr,
                     YDT: tl.constexpr, HAS_RES: tl.constexpr, SLOTS: tl.constexpr,
                     EXTRA: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_enter(PDL)
    if SLOTS:  # x = a MoE's slot rows ys [T * A, D], summed as moe_slots._moe_combine_kernel does
        acc = tl.zeros([BLOCK_D], tl.float32)
        for j in tl.static_range(A):  # unrolled: the A row loads are in flight together
            e = tl.load(ids_ptr + row * A + j)
            named = (e >= 0) & (e < E)
            acc += tl.load(ys_ptr + (row * A + j) * D + cols, mask=mask & named, other=0.0)
        r = round_to(acc, XDT)
        if EXTRA:  # the shared experts' output, added to the rounded sum as the op adds it
            ex = tl.load(ex_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            r = round_to(r + ex, XDT)
    else:
        r = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        r = round_to(r + res, XDT)
    if HAS_RES or SLOTS:
        tl.store(r_ptr + row * D + cols, r, mask=mask)
    mean_sq = tl.math.div_rn(tl.sum(r * r, axis=0), d_float)
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
    n = round_to(r * inv, XDT)
    tl.store(y_ptr + row * D + cols, round_to(w * n, YDT), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """t as [T, D] rows without a copy, or None when its leading dims do not merge."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def _tensor_refusal(name: str, t: torch.Tensor, x: torch.Tensor) -> str | None:
    if t.shape != x.shape:
        return f"{name} is {tuple(t.shape)}, x is {tuple(x.shape)}"
    if t.dtype != x.dtype:
        return f"{name} is {t.dtype}, x is {x.dtype}"
    if t.stride(-1) != 1 or _rows(t) is None:
        return f"{name} rows are not contiguous (strides {t.stride()})"
    return None


def _admit_triton(call: NormCall) -> str | None:
    x, w = call.x, call.weight
    reason = triton_refusal(x, call.forced)
    if reason is not None:
        return reason
    if x.dtype not in FLOAT_DTYPES or w.dtype not in FLOAT_DTYPES:
        return f"x is {x.dtype}, weight is {w.dtype} (the kernel takes bf16, fp16 or float32)"
    if x.dim() == 0 or tuple(w.shape) != (x.shape[-1],) or w.stride(0) != 1:
        return f"weight {tuple(w.shape)} is not one contiguous value per column of x {tuple(x.shape)}"
    if x.shape[-1] > MAX_D:
        return f"row width {x.shape[-1]} > {MAX_D} (one block per row)"
    reason = _tensor_refusal("x", x, x)
    if reason is None and call.residual is not None:
        reason = _tensor_refusal("residual", call.residual, x)
    if reason is None and call.slots is not None:
        reason = _slots_refusal(call.slots, x)
    return reason


def _slots_refusal(slots: SlotSum, x: torch.Tensor) -> str | None:
    ys = slots.ys
    if x.dim() != 2 or not x.is_contiguous():
        return f"a slot sum's output is {tuple(x.shape)} with strides {x.stride()}: the kernel writes contiguous [T, D]"
    if ys.dtype != torch.float32 or not ys.is_contiguous() or tuple(ys.shape) != (x.shape[0] * slots.a_top, x.shape[1]):
        return f"slot rows are {ys.dtype} {tuple(ys.shape)}: the kernel reads contiguous float32 [T * A, D]"
    ex = slots.extra
    if ex is not None and (ex.shape != x.shape or ex.dtype != x.dtype or not ex.is_contiguous()):
        return f"the slot sum's extra is {ex.dtype} {tuple(ex.shape)}: the kernel reads contiguous {x.dtype} {tuple(x.shape)}"
    return None


def _num_warps(block: int) -> int:
    """One warp per 512 padded columns, 1..16: the whole row in registers, a few per thread."""
    return max(1, min(16, block // 512))


def _run_triton(call: NormCall) -> tuple[torch.Tensor, torch.Tensor]:
    x, w, res, slots = call.x, call.weight, call.residual, call.slots
    D = x.shape[-1]
    x2 = _rows(x)  # [T, D]
    y = torch.empty(x.shape, dtype=torch.promote_types(w.dtype, x.dtype), device=x.device)
    # r: x + residual; a slot sum's own output when there is no residual (then x is r)
    r = x if res is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    res2 = x2 if res is None else _rows(res)
    if x2.shape[0] == 0:
        return y, r
    block = triton.next_power_of_2(D)
    ys, ids, a, e = (x2, x2, 0, 0) if slots is None else (slots.ys, slots.ids_flat, slots.a_top,
                                                          slots.num_experts)
    extra = slots.extra if slots is not None and slots.extra is not None else None
    launch.run(_rms_norm_kernel, (x2.shape[0],), x2, res2, w, y, r, ys, ids,
               x2 if extra is None else extra, D, float(D), x2.stride(0), res2.stride(0), call.eps,
               e, A=a, BLOCK_D=block, XDT=DTYPE_CODE[x.dtype], YDT=DTYPE_CODE[y.dtype],
               HAS_RES=res is not None, SLOTS=slots is not None, EXTRA=extra is not None,
               num_warps=_num_warps(block),
               **launch.pdl_args(x if slots is None else ys))
    return y, r


routes.register("norm", routes.Route("triton_rmsnorm", routes.DEFAULT, RECORD, _admit_triton,
                                     _run_triton))
routes.register("norm", routes.Route("torch", routes.DEFAULT, "reference (admits every call)",
                                     lambda call: None, _run_torch), reference=True)


def rms_norm(x: torch.Tensor | SlotSum, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, layer: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(y, r): r = x (+ residual), y = RMSNorm(r) * weight over the last dim (module docstring).
    x may be a fused MoE's SlotSum: the triton route then sums its slots in the same launch
    (the MoE's combine costs no launch of its own), the torch route first."""
    if isinstance(x, SlotSum):
        return routes.dispatch("norm", NormCall(x.out, weight, eps, residual, slots=x), layer)
    return routes.dispatch("norm", NormCall(x, weight, eps, residual), layer)
