"""ScalarFormat: the shared skeleton of the formats that have a LUT view.

Shape legend: L leading dims, N rows, K columns, B block size, NB = ceil(K / B), Kp = NB * B.
Every scalar payload has `codes` uint8 [L, N, Kp * bits / 8] and `scales` [L, N, NB];
K is padded with zeros to Kp (padding codes are what 0.0 encodes to).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit.formats.base import Format, LutView, PayloadSpec, num_blocks


class ScalarFormat(Format):
    scale_dtype: torch.dtype
    scale_kind: str

    def __init__(self, name: str, bits: int, block_size: int):
        assert block_size % 8 == 0, "blocks hold whole bytes of 3- and 4-bit codes"
        self.name = name
        self.bits = bits
        self.block_size = block_size

    def padded_k(self, k: int) -> int:
        return num_blocks(k, self.block_size) * self.block_size

    def payload_spec(self, shape: tuple[int, ...]) -> PayloadSpec:
        *lead, n, k = shape
        return {
            "codes": ((*lead, n, self.padded_k(k) * self.bits // 8), torch.uint8),
            "scales": ((*lead, n, num_blocks(k, self.block_size)), self.scale_dtype),
            **self.extra_spec(tuple(lead), n, k),
        }

    def extra_spec(self, lead: tuple[int, ...], n: int, k: int) -> PayloadSpec:
        return {}

    def _decode(self, payload: dict[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        k = shape[-1]
        return self.decode_padded(payload)[..., :k]

    def decode_padded(self, payload: dict[str, Tensor]) -> Tensor:
        """Payload -> float32 [L, N, Kp], computed from the format's own definition."""
        raise NotImplementedError

    def lut_view(self, payload: dict[str, Tensor]) -> LutView:
        table, index = self.view_table(payload)
        return LutView(
            codes=payload["codes"],
            bits=self.bits,
            block_size=self.block_size,
            table=table,
            table_index=index,
            scales=payload["scales"],
            scale_kind=self.scale_kind,
            global_scale=1.0,
            offsets=self.view_offsets(payload),
        )

    def view_table(self, payload: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError

    def view_offsets(self, payload: dict[str, Tensor]) -> Tensor | None:
        return None

    def block_fields(self, blocks: Tensor, payload: dict[str, Tensor]) -> dict[str, Tensor]:
        """The per-block payload fields encode picks for float32 blocks [L, N, B] (one block
        per row of each matrix): "scales" [L, N], plus int4's "zeros". Matrix-level fields
        (nvfp4's global scale, lut tables) are held at those of `payload`, a payload of the
        same [L, N, K] weight. Calibrated rounding fixes a block's scale with it, then
        chooses the block's codes itself."""
        raise NotImplementedError


def expand_blocks(values: Tensor, per_block: Tensor) -> Tensor:
    """values [L, N, Kp] (float32) * per_block [L, N, NB] broadcast over each block."""
    *lead, n, kp = values.shape
    nb = per_block.shape[-1]
    return (values.reshape(*lead, n, nb, kp // nb) * per_block[..., None]).reshape(values.shape)
