"""Asymmetric 4-bit integers with a zero point per group (the AWQ / GPTQ family):
w = (q - z) * s over groups of 128 weights along K (variants with groups of 64 and 32).

Shape legend: L leading dims, N rows, K columns, NB = ceil(K / G), Kp = G * NB.
Payload: codes uint8 [L, N, Kp / 2] (4-bit packing), scales float16 [L, N, NB],
         zeros uint8 [L, N, NB] (one zero point per byte; the encoder writes 0..15,
         decoding accepts any byte so GPTQ's off-by-one zero 16 survives import).
Encoding: lo = min(group_min, 0), hi = max(group_max, 0) (so 0.0 is exact);
  s = f16_rne(fp32((hi - lo) / 15)), refused if it overflows float16;
  z = clamp(rne(fp32(-lo / s)), 0, 15); q = clamp(rne(fp32(fp32(w / s) + z)), 0, 15)
  (ties go to the even code); s = 0 -> q = z = 0.
Decoding: w = fp32((q - z) * s), exact in float32.
LUT view: table [0, 1, ..., 15], scales as stored, offsets float32 fp32(-z * s) (exact,
so table * s + offset equals the decode bit for bit).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats.base import PayloadSpec, check_input, map_rows, num_blocks, padded_blocks
from lowbit.formats.codes import div_const, pack_codes, unpack_codes
from lowbit.formats.scalar import ScalarFormat, expand_blocks

F16_MAX = torch.finfo(torch.float16).max


class Int4Format(ScalarFormat):
    payload_names = ("codes", "scales", "zeros")
    scale_dtype = torch.float16
    scale_kind = "f16"

    def __init__(self, group_size: int = 128):
        name = "int4" if group_size == 128 else f"int4-g{group_size}"
        super().__init__(name, 4, group_size)

    def extra_spec(self, lead: tuple[int, ...], n: int, k: int) -> PayloadSpec:
        return {"zeros": ((*lead, n, num_blocks(k, self.block_size)), torch.uint8)}

    def encode(self, w: Tensor) -> dict[str, Tensor]:
        check_input(self, w)

        def rows(x: Tensor, r0: int, r1: int) -> dict[str, Tensor]:
            blocks = padded_blocks(x, self.block_size)  # [r, NB, G]
            s, z = self.scale_zero(blocks)
            d = s.float()
            safe = torch.where(d > 0, d, torch.ones_like(d))
            z = z.float()
            q = torch.round(blocks / safe[..., None] + z[..., None]).clamp(0, 15)
            q = torch.where(d[..., None] > 0, q, torch.zeros_like(q))
            codes = q.to(torch.uint8).reshape(x.shape[0], -1)
            return {"codes": pack_codes(codes, 4), "scales": s, "zeros": z.to(torch.uint8)}

        return map_rows(w, rows)

    def scale_zero(self, blocks: Tensor) -> tuple[Tensor, Tensor]:
        """float32 blocks [..., G] -> (float16 scale, uint8 zero point), each [...]."""
        lo = blocks.amin(-1).clamp(max=0.0)
        hi = blocks.amax(-1).clamp(min=0.0)
        s32 = div_const(hi - lo, 15.0)
        if bool((s32 > F16_MAX).any()):
            raise LowbitError(
                f"{self.name}: a group spans {float((hi - lo).max()):.4g}, beyond what a "
                "float16 scale holds; use nf4 or another format with bfloat16 scales."
            )
        s = s32.to(torch.float16)
        d = s.float()
        safe = torch.where(d > 0, d, torch.ones_like(d))
        z = torch.where(d > 0, torch.round(-lo / safe).clamp(0, 15), torch.zeros_like(d))
        return s, z.to(torch.uint8)

    def block_fields(self, blocks: Tensor, payload: dict[str, Tensor]) -> dict[str, Tensor]:
        s, z = self.scale_zero(blocks)
        return {"scales": s, "zeros": z}

    def decode_padded(self, payload: dict[str, Tensor]) -> Tensor:
        q = unpack_codes(payload["codes"], 4).float()
        nb = payload["zeros"].shape[-1]
        z = payload["zeros"].float().repeat_interleave(q.shape[-1] // nb, -1)
        return expand_blocks(q - z, payload["scales"].float())

    def view_table(self, payload: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        return torch.arange(16, dtype=torch.float32, device=payload["codes"].device)[None], None

    def view_offsets(self, payload: dict[str, Tensor]) -> Tensor | None:
        return -(payload["zeros"].float() * payload["scales"].float())
