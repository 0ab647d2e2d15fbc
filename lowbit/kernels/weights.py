"""Kernel-side weights: what a route reads, resolved once per weight object.

One path from a stored payload to what a kernel reads:
  QuantizedTensor (payload) -> LutView / Fp8View / VqWeight / DenseWeight (containers in
  lowbit.formats.views and lowbit.formats.base) -> resolve() (here) -> LutWeight (the
  kernel's decode decisions).

Shape legend: L leading dims (stacked experts), N rows (outputs), K logical columns
(inputs), Kp = K padded to whole blocks, B codes per scale, T tables.

A weight reaches `lowbit.kernels.linear` / `moe_experts` as one of
  - a plain tensor [L, N, K] (bf16 / fp16 / fp32: "dense"; float8_e4m3fn: fp8, scale 1);
  - an object with `lut_view()` (a 3/4-bit scalar format): `LutView`,
    w[n,k] = table[ti[n], code[n,k]] * scale(n, k//B) * g + offset(n, k//B);
  - a quantized tensor whose payload holds float8_e4m3fn codes (fp8, fp8-block, mxfp8):
    `Fp8View`, w[n,k] = code[n,k] * scale(n // block_rows, k // block_cols);
  - a quantized tensor in a vector codebook format (vq2, vq3, vq4): `VqWeight`.
`resolve()` turns it into a `DenseWeight`, `LutWeight`, `Fp8View` or `VqWeight`. A `LutWeight`
adds what the kernels decide per weight: how to turn a code into a value (a table gather, or
arithmetic when every table is affine in the code or a multiple of E2M1) with the
per-table factors. That classification reads the table on the host once per weight
object: the result is kept on the object (`_resolved`, with the payload fingerprint it was
made from), so warm a model up before capturing it in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats.base import LutView, lut_view_decode
from lowbit.formats.codes import e2m1_table
from lowbit.formats.views import DenseWeight, Fp8View, LutWeight, VqWeight
from lowbit.formats.vq import VqFormat, vq_decode

DECODE_GATHER = 0  # value = table[ti[n], code] (any table)
DECODE_AFFINE = 1  # value = alpha[t] * (1 + code / 2**bits) + beta[t]
DECODE_E2M1 = 2  # value = alpha[t] * e2m1(code) * 2**14 (via the float16 bit pattern)
DECODE_FP8 = 3  # value = float(code) for float8_e4m3fn codes
DECODE_NAMES = {DECODE_GATHER: "gather", DECODE_AFFINE: "affine", DECODE_E2M1: "e2m1"}
SCALE_KIND_IDS = {"f32": 0, "f16": 1, "bf16": 2, "e4m3": 3, "e8m0": 4}


Resolved = DenseWeight | LutWeight | Fp8View | VqWeight


def concat_rows(weights: list) -> LutWeight | None:
    """One LutWeight [sum N_i, K] that reads the rows of `weights` (quantized [N_i, K] weights
    with LUT views) one after the other: codes, scales and offsets concatenated, each part
    keeping its own table through a per-row table index. None when the views do not share
    bits, block, scale kind, K and global scale (then the weights stay separate). Made once
    (it reads the tables on the host, like `resolve`)."""
    if len(weights) < 2 or not all(hasattr(w, "lut_view") for w in weights):
        return None
    try:
        views = [w.lut_view() for w in weights]
    except LowbitError:  # a format without a LUT view (fp8, mxfp8, fp8-block)
        return None
    v0 = views[0]
    same = all(v.bits == v0.bits and v.block_size == v0.block_size and v.scale_kind == v0.scale_kind
               and v.codes.shape[:-2] == () and v.codes.shape[-1] == v0.codes.shape[-1]
               and v.global_scale == v0.global_scale and (v.offsets is None) == (v0.offsets is None)
               for v in views)
    if not same:
        return None
    tables, index, base = [], [], 0
    for v in views:
        n = v.codes.shape[-2]
        ti = torch.zeros(n, dtype=torch.int32, device=v.codes.device) if v.table_index is None else v.table_index
        index.append(ti + base)
        tables.append(v.table)
        base += v.table.shape[0]
    cat = lambda name: None if getattr(v0, name) is None else torch.cat([getattr(v, name) for v in views])
    view = LutView(cat("codes"), v0.bits, v0.block_size, torch.cat(tables), torch.cat(index).contiguous(),
                   cat("scales"), v0.scale_kind, v0.global_scale, cat("offsets"))
    return _lut_weight(view, None)


def expert_dense(w: Resolved, e: int, k: int) -> Tensor:
    """Reference decode of expert e of a stacked weight [E, N, K]: float32 [N, k], without
    decoding the other experts (a prefill touches many experts, each once)."""
    if isinstance(w, DenseWeight):
        return w.w[e, :, :k].float()
    if isinstance(w, Fp8View):
        return Fp8View(w.codes[e:e + 1], w.scales[e:e + 1], w.scale_kind, w.block_rows,
                       w.block_cols).dense(k)[0]
    if isinstance(w, VqWeight):
        return vq_decode(w.codes[e], w.scales[e], w.codebook, w.index_bits)[:, :k]
    v = w.view
    one = LutView(v.codes[e:e + 1], v.bits, v.block_size, v.table,
                  None if v.table_index is None else v.table_index[e:e + 1], v.scales[e:e + 1],
                  v.scale_kind, v.global_scale, None if v.offsets is None else v.offsets[e:e + 1])
    return lut_view_decode(one)[0, :, :k]


def classify_table(table: Tensor, bits: int) -> tuple[int, Tensor | None]:
    """Pick the cheapest exact decode for float32 tables [T, 2**bits] (read on the host)."""
    t = table.detach().to("cpu", torch.float32)
    codes = torch.arange(1 << bits, dtype=torch.float32)
    alpha, beta = t[:, 1] - t[:, 0], t[:, 0]
    if bool((alpha != 0).all()) and torch.equal(alpha[:, None] * codes + beta[:, None], t):
        # value = alpha' * (1 + c / 2**bits) + beta' with alpha' = alpha * 2**bits
        a = alpha * (1 << bits)
        return DECODE_AFFINE, torch.stack([a, beta - a], 1)
    if bits == 4:
        unit = t[:, 2]  # code 2 is E2M1 1.0
        if torch.equal(unit[:, None] * e2m1_table(), t):
            return DECODE_E2M1, torch.stack([unit * 2.0**14, torch.zeros_like(unit)], 1)
    return DECODE_GATHER, None


def _lut_weight(view: LutView, decode: str | None) -> LutWeight:
    if view.bits not in (3, 4):
        raise LowbitError(f"LUT kernels read 3- or 4-bit codes, got a {view.bits}-bit view.")
    mode, ab = classify_table(view.table, view.bits)
    if decode == "gather" or mode == DECODE_GATHER:
        return LutWeight(view, DECODE_GATHER, None)
    return LutWeight(view, mode, ab.to(view.table.device))


def _fp8_from_payload(w) -> Fp8View | None:
    payload = getattr(w, "payload", None)
    if not isinstance(payload, dict) or "codes" not in payload or "scales" not in payload:
        return None
    codes, scales = payload["codes"], payload["scales"]
    if codes.dtype != torch.float8_e4m3fn:
        return None
    n, kc = codes.shape[-2:]
    if scales.dtype == torch.uint8:  # mxfp8: E8M0 per 32 along K
        return Fp8View(codes, scales, "e8m0", 1, -(-kc // scales.shape[-1]))
    fmt = getattr(getattr(w, "format", None), "name", "")
    if fmt == "fp8-block" or (fmt != "fp8" and tuple(scales.shape[-2:]) == (-(-n // 128), -(-kc // 128))):
        return Fp8View(codes, scales, "f32", 128, 128)
    if scales.shape[-2] == n and scales.shape[-1] == 1:
        return Fp8View(codes, scales, "f32", 1, kc)
    br = -(-n // scales.shape[-2])
    bc = -(-kc // scales.shape[-1])
    return Fp8View(codes, scales, "f32", br, bc)


def _resolve_uncached(w, decode: str | None) -> Resolved:
    if isinstance(w, Tensor):
        if w.dtype == torch.float8_e4m3fn:
            ones = torch.ones(*w.shape[:-1], 1, dtype=torch.float32, device=w.device)
            return Fp8View(w, ones, "f32", 1, w.shape[-1])
        if not w.is_floating_point():
            raise LowbitError(f"a dense weight must be floating point, got {w.dtype}.")
        return DenseWeight(w)
    if isinstance(w, (LutView, Fp8View)):
        return _lut_weight(w, decode) if isinstance(w, LutView) else w
    fp8 = _fp8_from_payload(w)
    if fp8 is not None:
        return fp8
    fmt = getattr(w, "format", None)
    if isinstance(fmt, VqFormat):
        dev = w.payload["codes"].device
        return VqWeight(w.payload["codes"], w.payload["scales"], fmt.codebook.to(dev, torch.float32),
                        fmt.index_bits, fmt.name, fmt.packed_codebook.to(dev))
    if hasattr(w, "lut_view"):
        return _lut_weight(w.lut_view(), decode)
    raise LowbitError(
        f"cannot read a weight of type {type(w).__name__}: pass a tensor or a quantized "
        "tensor whose format has a LUT view (nvfp4, mxfp4, nf4, nf3, int4*, lut4, lut3) or fp8 codes."
    )


def _fingerprint(w) -> tuple:
    """The payload's tensors and their versions (an inference tensor has no version counter:
    it counts as 0, so only a new tensor there resolves again)."""
    payload = getattr(w, "payload", None)
    if isinstance(payload, dict):
        return tuple((k, t.data_ptr(), 0 if t.is_inference() else t._version) for k, t in payload.items())
    return ()


def resolve(w, decode: str | None = None) -> Resolved:
    """The kernel-side view of weight w; kept on w while its payload is unchanged.

    decode="gather" forces the table gather even where arithmetic would do (tests, bench).
    """
    if isinstance(w, (DenseWeight, LutWeight, VqWeight)):
        return w
    if isinstance(w, (Tensor, LutView, Fp8View)) or decode is not None:
        return _resolve_uncached(w, decode)
    fp = _fingerprint(w)
    hit = getattr(w, "_resolved", None)
    if hit is not None and hit[0] == fp:
        return hit[1]
    out = _resolve_uncached(w, None)
    try:
        w._resolved = (fp, out)
    except AttributeError:  # an object that takes no new attributes is resolved on each call
        pass
    return out
