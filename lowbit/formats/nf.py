"""Normal-float formats: `nf4` (the QLoRA NF4 table) and `nf3` (the 8-entry analogue),
64-weight blocks along K with a bfloat16 absmax scale.

Shape legend: L leading dims, N rows, K columns, NB = ceil(K / 64), Kp = 64 * NB.
Payload: codes uint8 [L, N, Kp * bits / 8], scales bfloat16 [L, N, NB].
Encoding: s = bf16_rne(min(block_amax, bf16_max)); code = nearest table entry to
fp32(w / s), ties to the even code (s = 0 -> the code of 0.0).  Decoding: fp32(table[code] * s).

NF3 is built the way QLoRA builds NF4, with 8 levels instead of 16: with
delta = (1 - 1/(2*7) + 1 - 1/(2*8)) / 2, the 4 positive levels are Phi^-1 of 4 points
spaced evenly from delta down to 1/2 (end excluded), the 3 negative levels are -Phi^-1 of 3
points from delta to 1/2 (end excluded), plus 0; all are divided by the largest, in float64,
then rounded to float32.  `normal_float_table` reproduces both tables.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit.formats.base import check_input, map_rows, padded_blocks
from lowbit.formats.codes import nearest_code, pack_codes, unpack_codes
from lowbit.formats.scalar import ScalarFormat, expand_blocks

NF_BLOCK = 64
BF16_MAX = torch.finfo(torch.bfloat16).max

# As published with QLoRA (bitsandbytes), float32.
NF4_TABLE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
# normal_float_table(8) rounded to float32 (hex: docs/FORMATS.md).
NF3_TABLE = (
    -1.0, -0.5350227355957031, -0.24693143367767334, 0.0,
    0.1833374798297882, 0.38199394941329956, 0.6229857206344604, 1.0,
)  # fmt: skip


def normal_float_table(levels: int) -> Tensor:
    """The QLoRA construction for `levels` codes (16 -> NF4 up to 1 ulp, 8 -> NF3), float32."""
    delta = (1 - 1 / (2 * (levels - 1)) + 1 - 1 / (2 * levels)) / 2
    half = levels // 2
    f64 = torch.float64
    pos = torch.special.ndtri(torch.linspace(delta, 0.5, half + 1, dtype=f64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(delta, 0.5, half, dtype=f64)[:-1])
    v = torch.cat([neg, torch.zeros(1, dtype=f64), pos]).sort().values
    return (v / v.max()).float()


def absmax_scales(blocks: Tensor) -> Tensor:
    """float32 [r, NB, B] -> bfloat16 [r, NB]: the block absmax, saturated to the bf16 range."""
    return blocks.abs().amax(-1).clamp(max=BF16_MAX).to(torch.bfloat16)


def normalise(blocks: Tensor, s: Tensor) -> Tensor:
    """fp32(w / s) per block, 0 where s = 0."""
    d = s.float()[..., None]
    safe = torch.where(d > 0, d, torch.ones_like(d))
    return torch.where(d > 0, blocks / safe, torch.zeros_like(blocks))


class NormalFloatFormat(ScalarFormat):
    payload_names = ("codes", "scales")
    scale_dtype = torch.bfloat16
    scale_kind = "bf16"

    def __init__(self, name: str, bits: int, table: tuple[float, ...]):
        super().__init__(name, bits, NF_BLOCK)
        self.table = torch.tensor(table, dtype=torch.float32)

    def encode(self, w: Tensor) -> dict[str, Tensor]:
        check_input(self, w)
        grid = self.table.to(w.device)

        def rows(x: Tensor, r0: int, r1: int) -> dict[str, Tensor]:
            blocks = padded_blocks(x, NF_BLOCK)
            s = absmax_scales(blocks)
            codes = nearest_code(normalise(blocks, s), grid).to(torch.uint8)
            return {"codes": pack_codes(codes.reshape(x.shape[0], -1), self.bits), "scales": s}

        return map_rows(w, rows)

    def block_fields(self, blocks: Tensor, payload: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"scales": absmax_scales(blocks)}

    def decode_padded(self, payload: dict[str, Tensor]) -> Tensor:
        codes = unpack_codes(payload["codes"], self.bits).long()
        return expand_blocks(self.table.to(codes.device)[codes], payload["scales"].float())

    def view_table(self, payload: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        return self.table.to(payload["codes"].device)[None, :], None
