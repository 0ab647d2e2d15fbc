"""FP8 E4M3 weights: `fp8` (one float32 scale per output row) and `fp8-block`
(one float32 scale per 128x128 tile, the DeepSeek-V3 `weight_scale_inv` layout).

Shape legend: L leading dims, N rows, K columns, BN = ceil(N / 128), BK = ceil(K / 128).
Payload (both): codes float8_e4m3fn [L, N, K], unpadded.
  fp8:       scales float32 [L, N, 1]     w[n, k] = fp32(codes[n, k] * scales[n, 0])
  fp8-block: scales float32 [L, BN, BK]   w[n, k] = fp32(codes[n, k] * scales[n // 128, k // 128])
Encoding: s = fp32(amax / 448); code = e4m3_rne(clamp(fp32(w / s), -448, 448)); s = 0 -> codes 0.
Edge tiles of fp8-block are partial (no padding stored); amax is taken over the real weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit.formats.base import Format, PayloadSpec, check_input, map_rows, num_blocks
from lowbit.formats.codes import E4M3_MAX, div_const, e4m3_encode

TILE = 128


def _quantize(x: Tensor, s: Tensor) -> Tensor:
    """x float32, s float32 broadcastable; s == 0 gives code 0."""
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return e4m3_encode(torch.where(s > 0, x / safe, torch.zeros_like(x)))


class Fp8Format(Format):
    name = "fp8"
    bits = 8
    block_size = None
    payload_names = ("codes", "scales")

    def payload_spec(self, shape: tuple[int, ...]) -> PayloadSpec:
        *lead, n, k = shape
        return {
            "codes": ((*lead, n, k), torch.float8_e4m3fn),
            "scales": ((*lead, n, 1), torch.float32),
        }

    def encode(self, w: Tensor) -> dict[str, Tensor]:
        check_input(self, w)

        def rows(x: Tensor, r0: int, r1: int) -> dict[str, Tensor]:
            x = x.float()
            s = div_const(x.abs().amax(-1, keepdim=True), E4M3_MAX)  # [r, 1]
            return {"codes": _quantize(x, s), "scales": s}

        return map_rows(w, rows)

    def _decode(self, payload: dict[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        return payload["codes"].float() * payload["scales"]


class Fp8BlockFormat(Format):
    name = "fp8-block"
    bits = 8
    block_size = TILE
    payload_names = ("codes", "scales")

    def payload_spec(self, shape: tuple[int, ...]) -> PayloadSpec:
        *lead, n, k = shape
        return {
            "codes": ((*lead, n, k), torch.float8_e4m3fn),
            "scales": ((*lead, num_blocks(n, TILE), num_blocks(k, TILE)), torch.float32),
        }

    def encode(self, w: Tensor) -> dict[str, Tensor]:
        check_input(self, w)
        *lead, n, k = w.shape
        bn, bk = num_blocks(n, TILE), num_blocks(k, TILE)
        flat = w.reshape(-1, n, k)
        codes = torch.empty(flat.shape, dtype=torch.float8_e4m3fn, device=w.device)
        scales = torch.empty((flat.shape[0], bn, bk), dtype=torch.float32, device=w.device)
        band_rows = max(1, (1 << 22) // (TILE * bk * TILE))  # tile rows per chunk
        for i in range(flat.shape[0]):
            for b0 in range(0, bn, band_rows):
                b1 = min(bn, b0 + band_rows)
                x = flat[i, b0 * TILE : b1 * TILE].float()  # [rows, K]
                pad = torch.nn.functional.pad(
                    x, (0, bk * TILE - k, 0, (b1 - b0) * TILE - x.shape[0])
                )
                tiles = pad.reshape(b1 - b0, TILE, bk, TILE)
                s = div_const(tiles.abs().amax(dim=(1, 3)), E4M3_MAX)  # [b, BK]
                q = _quantize(tiles, s[:, None, :, None]).reshape(pad.shape)
                codes[i, b0 * TILE : b1 * TILE] = q[: x.shape[0], :k]
                scales[i, b0:b1] = s
        return {"codes": codes.reshape(w.shape), "scales": scales.reshape(*lead, bn, bk)}

    def _decode(self, payload: dict[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        n, k = shape[-2:]
        s = payload["scales"].repeat_interleave(TILE, -2).repeat_interleave(TILE, -1)
        return payload["codes"].float() * s[..., :n, :k]
