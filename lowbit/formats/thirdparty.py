"""Read published third-party quantized layouts into our payloads (pure tensor transforms).

Each reader checks shapes and dtypes, then returns a QuantizedTensor of the matching
lowbit format; nothing is re-quantized, so decoding gives the publisher's values.
Shape legend: L leading dims, N output rows, K input columns, G group size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats import FORMATS, get_format
from lowbit.formats.base import QuantizedTensor, num_blocks
from lowbit.formats.codes import pack_codes

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i]


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise LowbitError(f"{what}; check that the tensors come from one weight of that layout.")


def _nibbles(x: Tensor) -> Tensor:
    """int32 [..., M] -> uint8 [..., M, 8]: nibble i is bits 4i..4i+3 (two's complement)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=x.device)
    return ((x.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def from_deepseek_fp8(weight_e4m3: Tensor, weight_scale_inv: Tensor) -> QuantizedTensor:
    """DeepSeek-V3 FP8: weight float8_e4m3fn [L, N, K] and `weight_scale_inv` float32
    [L, ceil(N/128), ceil(K/128)]; w = weight * scale_inv per 128x128 tile -> `fp8-block`."""
    w = weight_e4m3.view(torch.float8_e4m3fn) if weight_e4m3.dtype == torch.uint8 else weight_e4m3
    _need(
        w.dtype == torch.float8_e4m3fn and w.dim() >= 2,
        f"weight must be float8_e4m3fn [.., N, K], got {w.dtype} {list(w.shape)}",
    )
    *lead, n, k = w.shape
    want = (*lead, num_blocks(n, 128), num_blocks(k, 128))
    _need(
        tuple(weight_scale_inv.shape) == want and weight_scale_inv.is_floating_point(),
        f"weight_scale_inv must be float {list(want)} for a weight {list(w.shape)}, "
        f"got {weight_scale_inv.dtype} {list(weight_scale_inv.shape)}",
    )
    payload = {"codes": w, "scales": weight_scale_inv.float()}
    return QuantizedTensor(get_format("fp8-block"), tuple(w.shape), payload)


def from_gpt_oss_mxfp4(blocks: Tensor, scales: Tensor) -> QuantizedTensor:
    """gpt-oss MXFP4: `*_blocks` uint8 [L, N, K/32, 16] (element 2j in the low nibble of
    byte j) and `*_scales` uint8 E8M0 [L, N, K/32] -> `mxfp4` (zero-copy)."""
    _need(
        blocks.dtype == torch.uint8 and blocks.dim() >= 3 and blocks.shape[-1] == 16,
        f"blocks must be uint8 [.., N, K/32, 16], got {blocks.dtype} {list(blocks.shape)}",
    )
    _need(
        scales.dtype == torch.uint8 and tuple(scales.shape) == tuple(blocks.shape[:-1]),
        f"scales must be uint8 {list(blocks.shape[:-1])}, got {scales.dtype} {list(scales.shape)}",
    )
    *lead, n, nb, _ = blocks.shape
    codes = blocks.reshape(*lead, n, nb * 16)
    return QuantizedTensor(
        get_format("mxfp4"), (*lead, n, nb * 32), {"codes": codes, "scales": scales}
    )


def from_compressed_tensors_nvfp4(
    weight_packed: Tensor, weight_scale: Tensor, weight_global_scale: Tensor
) -> QuantizedTensor:
    """compressed-tensors NVFP4: `weight_packed` uint8 [L, N, K/2] (element 2j in the low
    nibble), `weight_scale` float8_e4m3fn [L, N, K/16], `weight_global_scale` float32 [L, 1]
    or [1].  Its global scale is a divisor (448 * 6 / amax), the reciprocal of ours:
    w = e2m1 * (scale / global) there, g = fp32(1 / global) here -> `nvfp4`."""
    _need(
        weight_packed.dtype == torch.uint8 and weight_packed.dim() >= 2,
        f"weight_packed must be uint8 [.., N, K/2], got {weight_packed.dtype} {list(weight_packed.shape)}",
    )
    *lead, n, half = weight_packed.shape
    k = 2 * half
    _need(k % 16 == 0, f"K = {k} must be a multiple of the NVFP4 block 16")
    want = (*lead, n, k // 16)
    _need(
        weight_scale.dtype == torch.float8_e4m3fn and tuple(weight_scale.shape) == want,
        f"weight_scale must be float8_e4m3fn {list(want)}, got {weight_scale.dtype} {list(weight_scale.shape)}",
    )
    gs = weight_global_scale.float()
    count = 1
    for d in lead:
        count *= d
    _need(gs.numel() == count, f"weight_global_scale needs {count} value(s), got {list(gs.shape)}")
    _need(bool((gs > 0).all()), "weight_global_scale must be positive")
    payload = {
        "codes": weight_packed,
        "scales": weight_scale,
        "global_scale": (1.0 / gs).reshape(lead),
    }
    return QuantizedTensor(get_format("nvfp4"), (*lead, n, k), payload)


def _int4_tensor(q: Tensor, z: Tensor, s: Tensor, group: int) -> QuantizedTensor:
    """q uint8 [N, K], z uint8 [N, K/G], s float16 [N, K/G] -> an int4 QuantizedTensor."""
    name = "int4" if group == 128 else f"int4-g{group}"
    if name not in FORMATS:
        raise LowbitError(
            f"group size {group} has no int4 format here (have 128, 64 and 32); "
            "re-quantize the checkpoint with one of those group sizes."
        )
    payload = {
        "codes": pack_codes(q.contiguous(), 4),
        "scales": s.contiguous(),
        "zeros": z.contiguous(),
    }
    return QuantizedTensor(FORMATS[name], tuple(q.shape), payload)


def _group_of(k: int, scales: Tensor, what: str) -> int:
    groups = scales.shape[0]
    _need(groups > 0 and k % groups == 0, f"{what}: {groups} scale rows do not divide K = {k}")
    return k // groups


def from_awq(qweight: Tensor, qzeros: Tensor, scales: Tensor) -> QuantizedTensor:
    """AutoAWQ GEMM layout: qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales
    float16 [K/G, N]; nibble i (bits 4i..4i+3) of each int32 holds column 8c + AWQ_ORDER[i];
    w[n, k] = (q - z) * s, no zero offset -> `int4` (G = 128) or `int4-g64` / `int4-g32`."""
    _need(qweight.dim() == 2 and qweight.dtype == torch.int32, "qweight must be int32 [K, N/8]")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    _need(tuple(scales.shape[1:]) == (n,), f"scales must be [K/G, {n}], got {list(scales.shape)}")
    g = _group_of(k, scales, "AWQ")
    _need(
        tuple(qzeros.shape) == (k // g, n // 8) and qzeros.dtype == torch.int32,
        f"qzeros must be int32 [{k // g}, {n // 8}], got {qzeros.dtype} {list(qzeros.shape)}",
    )
    inverse = torch.tensor([AWQ_ORDER.index(j) for j in range(8)], device=qweight.device)

    def unpack(x: Tensor) -> Tensor:  # int32 [R, N/8] -> uint8 [R, N] in column order
        return _nibbles(x)[..., inverse].reshape(x.shape[0], -1)

    return _int4_tensor(unpack(qweight).T, unpack(qzeros).T, scales.to(torch.float16).T, g)


def from_gptq(
    qweight: Tensor,
    qzeros: Tensor,
    scales: Tensor,
    g_idx: Tensor | None = None,
    zero_offset: int = 1,
) -> QuantizedTensor:
    """GPTQ (AutoGPTQ / GPTQModel) layout: qweight int32 [K/8, N] with nibble i of row r
    holding k = 8r + i; qzeros int32 [K/G, N/8] with nibble i of column c holding n = 8c + i;
    scales float16 [K/G, N]; g_idx int32 [K] (group of each input column).
    The stored zero is z - zero_offset: 1 in the original `gptq` format, 0 in `gptq_v2`.
    w[n, k] = (q - z) * s.  Act-order checkpoints (g_idx not k // G) are refused."""
    _need(qweight.dim() == 2 and qweight.dtype == torch.int32, "qweight must be int32 [K/8, N]")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    _need(tuple(scales.shape[1:]) == (n,), f"scales must be [K/G, {n}], got {list(scales.shape)}")
    g = _group_of(k, scales, "GPTQ")
    _need(
        tuple(qzeros.shape) == (k // g, n // 8) and qzeros.dtype == torch.int32,
        f"qzeros must be int32 [{k // g}, {n // 8}], got {qzeros.dtype} {list(qzeros.shape)}",
    )
    if g_idx is not None:
        trivial = torch.arange(k, device=g_idx.device) // g
        if tuple(g_idx.shape) != (k,) or not torch.equal(g_idx.long(), trivial):
            raise LowbitError(
                "this GPTQ weight uses act-order (desc_act): its g_idx does not put input "
                "column k in group k // group_size, which lowbit's int4 layout needs; "
                "re-quantize without desc_act, or with static groups."
            )
    q = _nibbles(qweight).permute(0, 2, 1).reshape(k, n)  # [K, N]
    z = _nibbles(qzeros).reshape(k // g, n).to(torch.int32) + zero_offset
    _need(bool(((z >= 0) & (z <= 255)).all()), "zero points fall outside 0..255")
    return _int4_tensor(q.T, z.to(torch.uint8).T, scales.to(torch.float16).T, g)
