"""Code packing and rounding onto a code grid, shared by every scalar format.

Shape legend: R rows (all leading dims and N flattened), K logical columns,
Kp = K padded to a whole number of blocks, B block size, T table size.

Memory layout of packed codes (one row, little-endian bytes):
  4-bit: byte j holds code 2j in bits 0-3 (low nibble) and code 2j+1 in bits 4-7.
  3-bit: codes 8g..8g+7 fill bytes 3g, 3g+1, 3g+2 read as v = b0 | b1 << 8 | b2 << 16;
         code 8g+i = (v >> 3i) & 7.
Invariant: Kp is a multiple of 8, so a row never shares a byte with the next row.
"""

from __future__ import annotations

import torch
from torch import Tensor

# E2M1 magnitudes in code order 0..7; bit 3 of a code is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_MAX = 448.0


def div_const(x: Tensor, d: float) -> Tensor:
    """fp32(x / d), correctly rounded on every device (CUDA would otherwise turn division
    by a Python number into multiplication by its rounded reciprocal)."""
    return x / torch.full((), d, dtype=x.dtype, device=x.device)


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes [..., Kp] (values < 2**bits) -> packed uint8 [..., Kp * bits / 8]."""
    kp = codes.shape[-1]
    if bits == 4:
        pairs = codes.reshape(*codes.shape[:-1], kp // 2, 2)
        return pairs[..., 0] | (pairs[..., 1] << 4)
    if bits == 3:
        groups = codes.reshape(*codes.shape[:-1], kp // 8, 8).to(torch.int32)
        shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=codes.device)
        v = (groups << shifts).sum(-1, dtype=torch.int32)  # [..., Kp/8], disjoint bits
        out = torch.stack([v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF], dim=-1)
        return out.to(torch.uint8).reshape(*codes.shape[:-1], kp // 8 * 3)
    raise AssertionError(f"no packing for {bits}-bit codes")


def unpack_codes(packed: Tensor, bits: int) -> Tensor:
    """Inverse of pack_codes: packed uint8 [..., Kp * bits / 8] -> uint8 codes [..., Kp]."""
    if bits == 4:
        out = torch.stack([packed & 0x0F, packed >> 4], dim=-1)
        return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    if bits == 3:
        trip = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 3, 3).to(torch.int32)
        v = trip[..., 0] | (trip[..., 1] << 8) | (trip[..., 2] << 16)
        shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=packed.device)
        out = (v.unsqueeze(-1) >> shifts) & 7
        return out.to(torch.uint8).reshape(*packed.shape[:-1], packed.shape[-1] // 3 * 8)
    raise AssertionError(f"no unpacking for {bits}-bit codes")


def nearest_code(x: Tensor, grid: Tensor) -> Tensor:
    """Index of the nearest grid value, ties to the even index; values beyond the ends saturate.

    x: float32 [..., M]; grid: float32 ascending, [T] or [..., T] matching x's leading dims.
    A tie is x exactly equal to the float32 midpoint fp32((g[i] + g[i+1]) / 2).
    Returns int32 [..., M].
    """
    mids = (grid[..., 1:] + grid[..., :-1]) * 0.5  # [..., T-1]
    if mids.dim() == 1:
        idx = torch.bucketize(x, mids, out_int32=True)  # first i with mids[i] >= x
        at = mids[idx.clamp(max=mids.shape[-1] - 1)]
    else:
        idx = torch.searchsorted(mids.contiguous(), x.contiguous(), out_int32=True)
        at = torch.gather(mids, -1, idx.clamp(max=mids.shape[-1] - 1).long())
    tie_up = (x == at) & (idx < mids.shape[-1]) & ((idx & 1) == 1)
    return idx + tie_up.to(idx.dtype)


def e2m1_encode(x: Tensor) -> Tensor:
    """float32 -> uint8 E2M1 codes: nearest magnitude, ties to even code, |x| > 6 -> 6.

    A value whose magnitude rounds to 0 gets code 0 (+0), whatever its sign.
    """
    grid = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=x.device)
    mag = nearest_code(x.abs(), grid)
    sign = (x < 0) & (mag > 0)
    return (mag | (sign.to(mag.dtype) << 3)).to(torch.uint8)


def e2m1_decode(codes: Tensor) -> Tensor:
    """uint8 E2M1 codes -> float32 from the bit fields s.ee.m (bias 1, subnormal at e = 0)."""
    c = codes.to(torch.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(torch.float32)
    normal = (1.0 + 0.5 * m) * torch.pow(2.0, (e - 1).to(torch.float32))
    mag = torch.where(e == 0, 0.5 * m, normal)
    return torch.where((c & 8) != 0, -mag, mag)


def e2m1_table(device: torch.device | str | None = None) -> Tensor:
    """float32 [16]: value of each E2M1 code, indexed by code."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def e4m3_encode(x: Tensor) -> Tensor:
    """float32 -> float8_e4m3fn: clamp to +-448, then round to nearest even."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e8m0_decode(b: Tensor) -> Tensor:
    """uint8 E8M0 -> float32 2**(b - 127) exactly; b = 0 gives 2**-127, b = 255 is NaN."""
    bits = b.to(torch.int32) << 23
    bits = torch.where(b == 0, torch.full_like(bits, 0x00400000), bits)
    val = bits.view(torch.float32)
    return torch.where(b == 255, torch.full_like(val, float("nan")), val)


def floor_log2(x: Tensor) -> Tensor:
    """Exact floor(log2(x)) as int32 for finite x > 0 (subnormals included)."""
    _, e = torch.frexp(x)
    return (e - 1).to(torch.int32)
