"""Vector codebook formats `vq2`, `vq3`, `vq4`: each group of D consecutive weights along K
is one index into a fixed codebook of C = 2**IB float16 vectors, times a bfloat16 scale per
64 weights.

Shape legend: L leading dims, N rows, K columns, D weights per group, IB index bits,
C = 2**IB codebook entries, NB = ceil(K / 64) scale blocks per row, Kp = 64 * NB,
G = Kp / D groups per row.

| format | D | IB | C    | bits per weight (K a multiple of 64) |
| vq2    | 4 | 8  | 256  | 2 + 16 / 64 = 2.25                   |
| vq3    | 4 | 12 | 4096 | 3 + 16 / 64 = 3.25                   |
| vq4    | 2 | 8  | 256  | 4 + 16 / 64 = 4.25                   |

Payload: codes uint8 [L, N, G * IB / 8], scales bfloat16 [L, N, NB].
  IB = 8: byte g of a row is the index of group g.
  IB = 12: groups 2j and 2j + 1 fill bytes 3j, 3j + 1, 3j + 2 read as
  v = b0 | b1 << 8 | b2 << 16; group 2j = v & 0xFFF, group 2j + 1 = v >> 12.
Decoding: w[n, D g + j] = fp32(float(codebook[code[n, g], j]) * float(scale[n, D g // 64])).
The codebooks are part of the format (no payload bytes): float16 [C, D] tensors in
lowbit/formats/vq_codebooks.safetensors, made once by scripts/gen_vq_codebooks.py (k-means
on Gaussian blocks of 64 normalised to unit mean square); docs/FORMATS.md has their sha256.

Encoding (reference, not normative: any payload decodes): per block of 64, with x the
block padded with zeros, s1 = bf16(sqrt(mean(x**2))), codes1 = nearest entries to x / s1;
s2 = bf16(<x, c1> / <c1, c1>) (the least-squares scale of those entries), codes2 = nearest
entries to x / s2; keep the pair with the smaller ||x - s c||**2 (the first on a tie).
Block sums are taken in float64; scales are clamped to [0, 2**125] before the bf16
rounding. "Nearest": see `nearest_entries`. A zero block gets s = 0 and the entry nearest
the origin.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats.base import (
    Format,
    PayloadSpec,
    check_input,
    map_rows,
    num_blocks,
    padded_blocks,
)

VQ_BLOCK = 64  # weights per scale
CODEBOOK_FILE = Path(__file__).with_name("vq_codebooks.safetensors")
# groups per chunk of the nearest-entry search: on the CPU a chunk's [rows, C] distances
# should stay in cache (256 x 4,096 float32 = 4 MB: 2x faster than 2,048 rows, measured on
# two cores); on a GPU larger chunks mean fewer launches
SEARCH_ROWS = {"cpu": 256}
SEARCH_ROWS_DEFAULT = 16384
SCALE_MAX = 2.0**125  # with every |entry| < 8, no decoded value overflows float32


def _codebooks() -> dict[str, Tensor]:
    return load_file(str(CODEBOOK_FILE)) if CODEBOOK_FILE.exists() else {}


def pack_indices(idx: Tensor, bits: int) -> Tensor:
    """int indices [..., G] (< 2**bits) -> uint8 [..., G * bits / 8] (layout: module docstring)."""
    if bits == 8:
        return idx.to(torch.uint8)
    if bits == 12:
        pairs = idx.to(torch.int32).reshape(*idx.shape[:-1], idx.shape[-1] // 2, 2)
        v = pairs[..., 0] | (pairs[..., 1] << 12)  # [..., G/2], 24 bits
        out = torch.stack([v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF], dim=-1)
        return out.to(torch.uint8).reshape(*idx.shape[:-1], idx.shape[-1] // 2 * 3)
    raise AssertionError(f"no packing for {bits}-bit indices")


def unpack_indices(packed: Tensor, bits: int) -> Tensor:
    """Inverse of pack_indices: uint8 [..., G * bits / 8] -> int64 indices [..., G]."""
    if bits == 8:
        return packed.long()
    if bits == 12:
        trip = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 3, 3).to(torch.int32)
        v = trip[..., 0] | (trip[..., 1] << 8) | (trip[..., 2] << 16)
        out = torch.stack([v & 0xFFF, v >> 12], dim=-1)
        return out.reshape(*packed.shape[:-1], packed.shape[-1] // 3 * 2).long()
    raise AssertionError(f"no unpacking for {bits}-bit indices")


def _two_least(score: Tensor, block: int = 64) -> Tensor:
    """Indices [r, 2] of the two least of each row of score [r, C]. For C a multiple of block
    (>= 4 blocks): the two blocks of least minimum hold both, so a min per block and two small
    top-2s stand in for one top-2 over C (a third of the time on the CPU at C = 4096)."""
    r, c = score.shape
    if c % block or c < 4 * block:
        return score.topk(2, -1, largest=False).indices
    blocks = score.view(r, c // block, block)
    bi = blocks.amin(-1).topk(2, -1, largest=False).indices  # [r, 2]
    j = blocks.gather(1, bi[:, :, None].expand(r, 2, block)).reshape(r, 2 * block).topk(2, -1, largest=False).indices
    return bi.gather(1, j // block) * block + j % block


def nearest_entries(x: Tensor, codebook: Tensor) -> Tensor:
    """x float32 [R, D], codebook float32 [C, D] -> int64 [R]: the entry of least
    ||x - c||^2. The two best by ||c||^2 - 2 <x, c> (a matmul) are compared exactly, the
    squared differences summed left to right in float32, the lower index on a tie (so the
    CPU and CUDA agree whatever order their matmuls sum in)."""
    norms = codebook.pow(2).sum(-1)  # [C]
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    step = SEARCH_ROWS.get(x.device.type, SEARCH_ROWS_DEFAULT)
    for r0 in range(0, x.shape[0], step):
        xs = x[r0:r0 + step]
        two = _two_least(torch.addmm(norms, xs, codebook.t(), alpha=-2.0)).sort(-1).values  # [r, 2]
        dist = torch.zeros(two.shape, device=x.device)
        for j in range(x.shape[1]):
            dist = dist + (xs[:, j, None] - codebook[two, j]).pow(2)
        out[r0:r0 + step] = two.gather(-1, (dist[:, 1] < dist[:, 0]).long()[:, None])[:, 0]
    return out


def pack_codebook(codebook: Tensor) -> Tensor | None:
    """float32 [C, D <= 4] -> int64 [C] of float16 bit patterns, lane j in bits 16 j .. 16 j + 15
    (VqWeight.packed: one gather a group), or None when an entry is not a float16 value
    (packing would round it)."""
    half = codebook.to(torch.float16)
    if codebook.shape[-1] > 4 or not torch.equal(half.float(), codebook):
        return None
    bits = half.view(torch.int16).long() & 0xFFFF  # [C, D]
    shifts = 16 * torch.arange(bits.shape[-1], device=bits.device)
    return (bits << shifts).sum(-1)


def vq_decode(codes: Tensor, scales: Tensor, codebook: Tensor, bits: int) -> Tensor:
    """Reference twin of the decode kernels: payload -> float32 [L, N, Kp]."""
    idx = unpack_indices(codes, bits)  # [L, N, G]
    d = codebook.shape[-1]
    vals = codebook.float().to(codes.device)[idx]  # [L, N, G, D]
    *lead, n, g, _ = vals.shape
    kp = g * d
    vals = vals.reshape(*lead, n, kp // VQ_BLOCK, VQ_BLOCK)
    return (vals * scales.float()[..., None]).reshape(*lead, n, kp)


def _scale(v: Tensor) -> Tensor:
    """float64 -> bfloat16 scale, clamped to [0, SCALE_MAX]."""
    return v.clamp(0, SCALE_MAX).float().to(torch.bfloat16)


class VqFormat(Format):
    """A fixed-codebook vector format (table in the module docstring)."""

    payload_names = ("codes", "scales")

    def __init__(self, name: str, dim: int, index_bits: int):
        assert VQ_BLOCK % dim == 0 and (VQ_BLOCK // dim * index_bits) % 8 == 0
        self.name = name
        self.dim = dim
        self.index_bits = index_bits
        self.bits = index_bits // dim  # code bits per weight
        self.block_size = VQ_BLOCK
        self._codebook: Tensor | None = None
        self._packed: Tensor | None = None

    @property
    def codebook(self) -> Tensor:
        """float16 [C, D] (loaded on first use)."""
        if self._codebook is None:
            cb = _codebooks().get(self.name)
            want = (1 << self.index_bits, self.dim)
            if cb is None or tuple(cb.shape) != want or cb.dtype != torch.float16:
                raise LowbitError(
                    f"{self.name}: {CODEBOOK_FILE} lacks a float16 {list(want)} codebook; "
                    "reinstall lowbit or run scripts/gen_vq_codebooks.py."
                )
            self._codebook = cb
        return self._codebook

    @property
    def packed_codebook(self) -> Tensor:
        """int64 [C]: the codebook packed for the decode kernels (pack_codebook; float16
        entries always pack), made once on the host."""
        if self._packed is None:
            self._packed = pack_codebook(self.codebook.float())
        return self._packed

    def payload_spec(self, shape: tuple[int, ...]) -> PayloadSpec:
        *lead, n, k = shape
        nb = num_blocks(k, VQ_BLOCK)
        groups = nb * VQ_BLOCK // self.dim
        return {
            "codes": ((*lead, n, groups * self.index_bits // 8), torch.uint8),
            "scales": ((*lead, n, nb), torch.bfloat16),
        }

    def encode(self, w: Tensor) -> dict[str, Tensor]:
        check_input(self, w)
        cb = self.codebook.to(w.device, torch.float32)

        def rows(x: Tensor, r0: int, r1: int) -> dict[str, Tensor]:
            blocks = padded_blocks(x, VQ_BLOCK)  # [r, NB, 64]
            s, idx = self.encode_blocks(blocks, cb)
            return {"codes": pack_indices(idx.reshape(x.shape[0], -1), self.index_bits), "scales": s}

        return map_rows(w, rows)

    def encode_blocks(self, blocks: Tensor, cb: Tensor) -> tuple[Tensor, Tensor]:
        """float32 [..., 64] blocks -> (bf16 scales [...], int64 indices [..., 64 / D])."""
        b64 = blocks.double()
        s1 = _scale(b64.pow(2).mean(-1).sqrt())
        i1, e1, c1 = self._assign(blocks, s1, cb)
        c64 = c1.double()
        ls = (b64 * c64).sum(-1) / c64.pow(2).sum(-1).clamp(min=1e-300)
        s2 = _scale(torch.where(s1 > 0, ls, 0.0))
        i2, e2, _ = self._assign(blocks, s2, cb)
        second = e2 < e1
        return torch.where(second, s2, s1), torch.where(second[..., None], i2, i1)

    def _assign(self, blocks: Tensor, s: Tensor, cb: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Nearest entries to blocks / s: indices [..., 64/D], squared error [...] (float64),
        entries [..., 64] (unscaled)."""
        d = s.float()[..., None]
        x = torch.where(d > 0, blocks / torch.where(d > 0, d, 1.0), 0.0)
        idx = nearest_entries(x.reshape(-1, self.dim), cb).reshape(*blocks.shape[:-1], -1)
        c = cb[idx].reshape(blocks.shape)
        return idx, (blocks.double() - (c * d).double()).pow(2).sum(-1), c

    def _decode(self, payload: dict[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        w = vq_decode(payload["codes"], payload["scales"], self.codebook, self.index_bits)
        return w[..., : shape[-1]]

    def __repr__(self) -> str:
        return f"VqFormat({self.name!r}, D={self.dim}, IB={self.index_bits})"


VQ_FORMATS = (VqFormat("vq2", 4, 8), VqFormat("vq3", 4, 12), VqFormat("vq4", 2, 8))
