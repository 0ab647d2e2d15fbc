"""OCP Microscaling v1.0: `mxfp4` (E2M1 elements) and `mxfp8` (E4M3 elements), 32-weight
blocks along K sharing one E8M0 scale.

Shape legend: L leading dims, N rows, K columns, NB = ceil(K / 32), Kp = 32 * NB.
Payload: mxfp4 codes uint8 [L, N, Kp / 2] (4-bit packing); mxfp8 codes float8_e4m3fn
         [L, N, Kp]; both scales uint8 [L, N, NB], E8M0: scale = 2**(byte - 127).
Encoding (the OCP recipe): X = floor(log2(block_amax)) - emax_elem, emax_elem = 2 for
E2M1 (6 = 1.5 * 2**2) and 8 for E4M3 (448 = 1.75 * 2**8); X is clamped to [-127, 127] and
X = -127 when amax = 0. Elements are fp32(w * 2**-X) (exact), rounded to nearest even and
saturated to +-6 / +-448 (block_amax / 2**X lies in [2**emax, 2**(emax+1)), so the top of
that range clips).  Decoding: w = fp32(element * 2**X).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit.formats.base import (
    Format,
    PayloadSpec,
    check_input,
    map_rows,
    num_blocks,
    padded_blocks,
)
from lowbit.formats.codes import (
    e2m1_decode,
    e2m1_encode,
    e2m1_table,
    e4m3_encode,
    e8m0_decode,
    floor_log2,
    pack_codes,
    unpack_codes,
)
from lowbit.formats.scalar import ScalarFormat, expand_blocks

MX_BLOCK = 32


def mx_scale(blocks: Tensor, emax_elem: int) -> tuple[Tensor, Tensor]:
    """blocks float32 [r, NB, 32] -> (E8M0 bytes uint8 [r, NB], exact 2**-X float32 [r, NB])."""
    amax = blocks.abs().amax(-1)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    x = torch.where(
        amax > 0, floor_log2(safe) - emax_elem, torch.full_like(amax, -127, dtype=torch.int32)
    )
    byte = (x.clamp(-127, 127) + 127).to(torch.uint8)
    return byte, e8m0_decode(254 - byte)


class Mxfp4Format(ScalarFormat):
    payload_names = ("codes", "scales")
    scale_dtype = torch.uint8
    scale_kind = "e8m0"

    def __init__(self) -> None:
        super().__init__("mxfp4", 4, MX_BLOCK)

    def encode(self, w: Tensor) -> dict[str, Tensor]:
        check_input(self, w)

        def rows(x: Tensor, r0: int, r1: int) -> dict[str, Tensor]:
            blocks = padded_blocks(x, MX_BLOCK)
            byte, inv = mx_scale(blocks, 2)
            codes = e2m1_encode(blocks * inv[..., None]).reshape(x.shape[0], -1)
            return {"codes": pack_codes(codes, 4), "scales": byte}

        return map_rows(w, rows)

    def block_fields(self, blocks: Tensor, payload: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"scales": mx_scale(blocks, 2)[0]}

    def decode_padded(self, payload: dict[str, Tensor]) -> Tensor:
        vals = e2m1_decode(unpack_codes(payload["codes"], 4))
        return expand_blocks(vals, e8m0_decode(payload["scales"]))

    def view_table(self, payload: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        return e2m1_table(payload["codes"].device)[None, :], None


class Mxfp8Format(Format):
    name = "mxfp8"
    bits = 8
    block_size = MX_BLOCK
    payload_names = ("codes", "scales")

    def payload_spec(self, shape: tuple[int, ...]) -> PayloadSpec:
        *lead, n, k = shape
        nb = num_blocks(k, MX_BLOCK)
        return {
            "codes": ((*lead, n, nb * MX_BLOCK), torch.float8_e4m3fn),
            "scales": ((*lead, n, nb), torch.uint8),
        }

    def encode(self, w: Tensor) -> dict[str, Tensor]:
        check_input(self, w)

        def rows(x: Tensor, r0: int, r1: int) -> dict[str, Tensor]:
            blocks = padded_blocks(x, MX_BLOCK)
            byte, inv = mx_scale(blocks, 8)
            codes = e4m3_encode(blocks * inv[..., None]).reshape(x.shape[0], -1)
            return {"codes": codes, "scales": byte}

        return map_rows(w, rows)

    def _decode(self, payload: dict[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        vals = expand_blocks(payload["codes"].float(), e8m0_decode(payload["scales"]))
        return vals[..., : shape[-1]]
