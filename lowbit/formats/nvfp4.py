"""NVFP4: E2M1 codes, 16-weight blocks with an E4M3 block scale, one float32 global scale
per [N, K] matrix (per leading index for stacked experts).

Shape legend: L leading dims, N rows, K columns, NB = ceil(K / 16), Kp = 16 * NB.
Payload: codes uint8 [L, N, Kp / 2] (4-bit packing), scales float8_e4m3fn [L, N, NB],
         global_scale float32 [L] (a 0-dim tensor for a single matrix).
Encoding (NVIDIA's published recipe):
  g = fp32(amax / 2688) over the matrix (2688 = 6 * 448); g = 1 if that is 0
  s = e4m3_rne(clamp(fp32(fp32(block_amax / 6) / g), 0, 448))
  d = fp32(s * g); code = e2m1_rne(fp32(w / d)) saturating at +-6; d = 0 -> code 0
Decoding: w = fp32(fp32(e2m1(code) * g) * s).
LUT view: g is folded into the table (one table per matrix), global_scale = 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit.formats.base import PayloadSpec, check_input, map_rows, padded_blocks
from lowbit.formats.codes import (
    E4M3_MAX,
    div_const,
    e2m1_decode,
    e2m1_encode,
    e2m1_table,
    e4m3_encode,
    pack_codes,
    unpack_codes,
)
from lowbit.formats.scalar import ScalarFormat, expand_blocks

E2M1_MAX = 6.0


def global_scale_of(w: Tensor) -> Tensor:
    """float32 [L]: amax / 2688 per matrix, 1.0 where that is 0."""
    flat = w.reshape(*w.shape[:-2], -1)
    amax = torch.maximum(flat.amax(-1), -flat.amin(-1)).float()  # no |w| copy of the stack
    g = div_const(amax, E2M1_MAX * E4M3_MAX)
    return torch.where(g > 0, g, torch.ones_like(g))


class Nvfp4Format(ScalarFormat):
    payload_names = ("codes", "scales", "global_scale")
    scale_dtype = torch.float8_e4m3fn
    scale_kind = "e4m3"

    def __init__(self) -> None:
        super().__init__("nvfp4", 4, 16)

    def extra_spec(self, lead: tuple[int, ...], n: int, k: int) -> PayloadSpec:
        return {"global_scale": (lead, torch.float32)}

    def encode(self, w: Tensor) -> dict[str, Tensor]:
        check_input(self, w)
        g = global_scale_of(w)  # [L]
        n = w.shape[-2]
        g_rows = g.reshape(-1, 1).expand(-1, n).reshape(-1)  # [L * N]

        def rows(x: Tensor, r0: int, r1: int) -> dict[str, Tensor]:
            blocks = padded_blocks(x, 16)  # [r, NB, 16]
            gr = g_rows[r0:r1, None]  # [r, 1]
            s = e4m3_encode(div_const(blocks.abs().amax(-1), E2M1_MAX) / gr)  # [r, NB]
            d = (s.float() * gr)[..., None]
            safe = torch.where(d > 0, d, torch.ones_like(d))
            x = torch.where(d > 0, blocks / safe, torch.zeros_like(blocks))
            codes = e2m1_encode(x).reshape(x.shape[0], -1)
            return {"codes": pack_codes(codes, 4), "scales": s}

        return {**map_rows(w, rows), "global_scale": g}

    def block_fields(self, blocks: Tensor, payload: dict[str, Tensor]) -> dict[str, Tensor]:
        g = payload["global_scale"].reshape(-1, 1)  # [L, 1]
        return {"scales": e4m3_encode(div_const(blocks.abs().amax(-1), E2M1_MAX) / g)}

    def decode_padded(self, payload: dict[str, Tensor]) -> Tensor:
        vals = e2m1_decode(unpack_codes(payload["codes"], 4))  # [L, N, Kp]
        vals = vals * payload["global_scale"][..., None, None]
        return expand_blocks(vals, payload["scales"].float())

    def view_table(self, payload: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        g = payload["global_scale"].reshape(-1, 1)  # [T, 1], one table per matrix
        table = e2m1_table(g.device)[None, :] * g
        if table.shape[0] == 1:
            return table, None
        lead_n = payload["codes"].shape[:-1]
        index = torch.arange(table.shape[0], dtype=torch.int32, device=g.device)
        return table, index.reshape(*lead_n[:-1], 1).expand(lead_n).contiguous()
