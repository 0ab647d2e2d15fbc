"""Kernel-readable weight views: the containers a dequantizing kernel reads.

One path from a stored payload to what a kernel reads:
  QuantizedTensor (payload, lowbit.formats.base)
    -> LutView / Fp8View / VqWeight / DenseWeight (this module and LutView in formats.base)
    -> lowbit.kernels.weights.resolve()
    -> LutWeight (a LutView plus the kernel's decode decision)

Shape legend: L leading dims (stacked experts), N rows (outputs), K logical columns
(inputs), Kp = K padded to whole blocks, Kc code columns stored per row, C codebook
entries of D values. Every container exposes `lead`, `n`, `kp` and `dense(k)`, the
reference decode float32 [L, N, k]. Pure torch: nothing here imports lowbit.kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from lowbit.formats.base import LutView, lut_view_decode
from lowbit.formats.codes import e8m0_decode
from lowbit.formats.vq import vq_decode


class _Stacked:
    """lead and n from the container's row tensor [L, N, ...] (`_rows`)."""

    @property
    def _rows(self) -> Tensor:
        raise NotImplementedError

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self._rows.shape[:-2])

    @property
    def n(self) -> int:
        return self._rows.shape[-2]


@dataclass
class DenseWeight(_Stacked):
    w: Tensor  # [L, N, K] floating point

    @property
    def _rows(self) -> Tensor:
        return self.w

    @property
    def kp(self) -> int:
        return self.w.shape[-1]

    def dense(self, k: int) -> Tensor:
        return self.w[..., :k].float()


@dataclass
class Fp8View(_Stacked):
    """float8_e4m3fn codes [L, N, Kc] (Kc >= K) and scales [L, ceil(N/br), ceil(Kc/bc)].

    block_rows is 1 (one scale row per weight row) or 128 (fp8-block); block_cols is
    the codes per scale along K (32 for mxfp8, 128 for fp8-block, Kc for per-channel).
    """

    codes: Tensor
    scales: Tensor
    scale_kind: str  # "f32" or "e8m0"
    block_rows: int
    block_cols: int

    @property
    def _rows(self) -> Tensor:
        return self.codes

    @property
    def kp(self) -> int:
        return self.codes.shape[-1]

    def dense(self, k: int) -> Tensor:
        """Reference decode: float32 [L, N, k]."""
        s = self.scales.float() if self.scale_kind == "f32" else e8m0_decode(self.scales)
        s = s.repeat_interleave(self.block_rows, -2)[..., : self.n, :]
        s = s.repeat_interleave(self.block_cols, -1)[..., : self.kp]
        return (self.codes.float() * s)[..., :k]


@dataclass
class LutWeight(_Stacked):
    """A LutView plus the kernel's decode choice (lowbit.kernels.weights.DECODE_*, made by
    resolve()). alpha_beta: float32 [T, 2] per-table (alpha, beta) for the arithmetic
    decodes, None for the gather."""

    view: LutView
    decode: int
    alpha_beta: Tensor | None

    @property
    def _rows(self) -> Tensor:
        return self.view.codes

    @property
    def kp(self) -> int:
        return self.view.codes.shape[-1] * 8 // self.view.bits

    def dense(self, k: int) -> Tensor:
        return lut_view_decode(self.view)[..., :k]

    @property
    def nbytes(self) -> int:
        v = self.view
        parts = (v.codes, v.scales, v.table, v.table_index, v.offsets)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


@dataclass
class VqWeight(_Stacked):
    """A vector codebook weight (lowbit.formats.vq): codes uint8 [L, N, G * IB / 8], scales
    bfloat16 [L, N, Kp / 64], codebook float32 [C, D] on the codes' device;
    w[n, D g + j] = codebook[code[n, g], j] * scale(n, D g // 64)."""

    codes: Tensor
    scales: Tensor
    codebook: Tensor
    index_bits: int
    name: str
    # int64 [C]: entry c's D float16 bit patterns, lane j in bits 16 j .. 16 j + 15 (one
    # gather a group); None unless every entry is a float16 value (the shipped codebooks are)
    packed: Tensor | None = None

    @property
    def dim(self) -> int:
        return self.codebook.shape[-1]

    @property
    def _rows(self) -> Tensor:
        return self.codes

    @property
    def kp(self) -> int:
        return self.scales.shape[-1] * 64

    def dense(self, k: int) -> Tensor:
        return vq_decode(self.codes, self.scales, self.codebook, self.index_bits)[..., :k]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales))

