"""The Format interface, QuantizedTensor, and the LUT view shared by all scalar formats.

Shape legend: L leading dims (stacked experts, e.g. [E]), N output rows, K input columns
(blocks run along K), B block size, NB = ceil(K / B) blocks per row, Kp = NB * B.

Invariant: every payload tensor starts with the leading dims L, so `qt[e]` is the same
index applied to each payload tensor.  docs/FORMATS.md is the normative description.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats.codes import e8m0_decode, unpack_codes

ACCEPTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_KINDS = ("f16", "bf16", "f32", "e4m3", "e8m0")
CHUNK_ELEMS = 1 << 22  # encoders work on row chunks of about this many weights

PayloadSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass
class LutView:
    """What the dequantizing GEMM family reads: w = table[ti, code] * scale * global + offset.

    codes: uint8 [L, N, Kp * bits / 8] (packing in lowbit.formats.codes).
    table: float32 [T, 2**bits]; table_index: int32 [L, N] or None when T == 1.
    scales: [L, N, NB] in native dtype, read as scale_kind.
    offsets: None or [L, N, NB] float16 / bfloat16 / float32, added after scaling.
    """

    codes: Tensor
    bits: int
    block_size: int
    table: Tensor
    table_index: Tensor | None
    scales: Tensor
    scale_kind: str
    global_scale: float = 1.0
    offsets: Tensor | None = None


def decode_scales(scales: Tensor, kind: str) -> Tensor:
    """Native scale tensor -> float32, exactly."""
    if kind == "e8m0":
        return e8m0_decode(scales)
    if kind in ("f16", "bf16", "f32", "e4m3"):
        return scales.float()
    raise AssertionError(f"unknown scale kind {kind}")


def lut_view_decode(view: LutView) -> Tensor:
    """Reference twin of the LUT kernels: float32 [L, N, Kp], evaluated in this order
    w = fp32(fp32(fp32(table[ti, code] * scale) * global_scale) + offset)."""
    codes = unpack_codes(view.codes, view.bits).long()  # [L, N, Kp]
    *lead, n, kp = codes.shape
    nb = view.scales.shape[-1]
    assert kp == nb * view.block_size, "codes and scales disagree on the block count"
    width = 1 << view.bits
    if view.table_index is None:
        vals = view.table[0][codes]
    else:
        flat = view.table_index.long().unsqueeze(-1) * width + codes
        vals = view.table.reshape(-1)[flat]
    w = (
        vals.reshape(*lead, n, nb, view.block_size)
        * decode_scales(view.scales, view.scale_kind)[..., None]
    )
    if view.global_scale != 1.0:
        w = w * torch.tensor(view.global_scale, dtype=torch.float32)
    if view.offsets is not None:
        w = w + view.offsets.float()[..., None]
    return w.reshape(*lead, n, kp)


class Format(ABC):
    """A weight format: encode [L, N, K] float weights to a payload and decode them back."""

    name: str
    bits: int  # code bits per weight
    block_size: int | None  # weights per scale along K; None: one scale per row
    payload_names: tuple[str, ...]
    pads_k: bool = True  # K not a multiple of the block: pad with zeros (else refuse)

    @abstractmethod
    def payload_spec(self, shape: tuple[int, ...]) -> PayloadSpec:
        """Shape and dtype of each payload tensor for a logical weight shape [L, N, K]."""

    @abstractmethod
    def encode(self, w: Tensor) -> dict[str, Tensor]:
        """Float weights [L, N, K] -> payload."""

    @abstractmethod
    def _decode(self, payload: dict[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        """Payload -> float32 [L, N, K] (payload already checked)."""

    def decode(
        self, payload: dict[str, Tensor], shape: tuple[int, ...], dtype: torch.dtype = torch.float32
    ) -> Tensor:
        shape = tuple(int(s) for s in shape)
        self.check_payload(payload, shape)
        return self._decode(payload, shape).to(dtype)

    def lut_view(self, payload: dict[str, Tensor]) -> LutView:
        raise LowbitError(
            f"format {self.name!r} has no LUT view (it is not a scalar 3/4-bit format); "
            "use its own decode or a format from nvfp4, mxfp4, nf4, nf3, int4, lut4, lut3."
        )

    def payload_bits(self, shape: tuple[int, ...]) -> int:
        spec = self.payload_spec(tuple(shape))
        return sum(
            math.prod(s) * torch.empty((), dtype=d).element_size() * 8 for s, d in spec.values()
        )

    def bits_per_weight(self, shape: tuple[int, ...]) -> float:
        """Exact storage cost: every payload byte (codes, scales, tables) over the weight count."""
        check_shape(self, tuple(shape))
        return self.payload_bits(shape) / math.prod(shape)

    def quantize(self, w: Tensor) -> QuantizedTensor:
        return QuantizedTensor(self, tuple(w.shape), self.encode(w))

    def check_payload(self, payload: dict[str, Tensor], shape: tuple[int, ...]) -> None:
        spec = self.payload_spec(shape)
        if set(payload) != set(spec):
            raise LowbitError(
                f"{self.name} payload has tensors {sorted(payload)} but needs {sorted(spec)}; "
                "the artifact is incomplete or was written for another format."
            )
        for key, (s, d) in spec.items():
            t = payload[key]
            if tuple(t.shape) != s or t.dtype != d:
                raise LowbitError(
                    f"{self.name} payload tensor {key!r} is {t.dtype} {list(t.shape)} but a "
                    f"weight of shape {list(shape)} needs {d} {list(s)}; re-export the artifact."
                )

    def __repr__(self) -> str:
        return f"Format({self.name!r})"


def check_shape(fmt: Format, shape: tuple[int, ...]) -> None:
    if len(shape) < 2 or min(shape) < 1:
        raise LowbitError(
            f"{fmt.name} needs a weight of shape [..., N, K] with every dim >= 1, got {list(shape)}."
        )
    if not fmt.pads_k and fmt.block_size and shape[-1] % fmt.block_size:
        raise LowbitError(
            f"{fmt.name} needs K (last dim) to be a multiple of its block {fmt.block_size}, got "
            f"shape {list(shape)}; pick a format that pads, or pad the weight's input dim."
        )


def check_input(fmt: Format, w: Tensor) -> None:
    """Refuse what no encoder should guess about: odd dtypes, bad shapes, NaN/Inf."""
    if w.dtype not in ACCEPTED_DTYPES:
        raise LowbitError(
            f"{fmt.name} encodes float32, bfloat16 or float16 weights, got {w.dtype}; "
            "convert the tensor first."
        )
    check_shape(fmt, tuple(w.shape))
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        flat = int(bad.reshape(-1).nonzero()[0, 0])
        pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), w.shape))
        raise LowbitError(
            f"{fmt.name} refuses non-finite weights: {float(w[pos])} at index {list(pos)}; "
            "repair or drop that tensor in the checkpoint before quantizing."
        )


def num_blocks(k: int, b: int) -> int:
    return -(-k // b)


def row_chunks(rows: int, k: int) -> Iterator[tuple[int, int]]:
    step = max(1, CHUNK_ELEMS // max(k, 1))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def padded_blocks(rows: Tensor, b: int) -> Tensor:
    """float rows [R, K] -> float32 [R, NB, B], zero padded on the right."""
    r, k = rows.shape
    nb = num_blocks(k, b)
    x = rows.float()
    if nb * b != k:
        x = torch.nn.functional.pad(x, (0, nb * b - k))
    return x.reshape(r, nb, b)


def map_rows(w: Tensor, fn: Callable[[Tensor, int, int], dict[str, Tensor]]) -> dict[str, Tensor]:
    """Run fn(rows [r, K], r0, r1) over row chunks of w [L, N, K]; each output [r, ...]
    is concatenated and reshaped to [L, N, ...]."""
    lead_n = tuple(w.shape[:-1])
    rows = w.reshape(-1, w.shape[-1])
    parts: dict[str, list[Tensor]] = {}
    for r0, r1 in row_chunks(rows.shape[0], rows.shape[1]):
        for key, t in fn(rows[r0:r1], r0, r1).items():
            parts.setdefault(key, []).append(t)
    return {k: torch.cat(v).reshape(*lead_n, *v[0].shape[1:]) for k, v in parts.items()}


class QuantizedTensor:
    """A weight held in a format: logical shape [L, N, K] plus its payload tensors."""

    def __init__(self, fmt: Format, shape: tuple[int, ...], payload: dict[str, Tensor]):
        self.format = fmt
        self.shape = tuple(int(s) for s in shape)
        self.payload = dict(payload)
        fmt.check_payload(self.payload, self.shape)
        # (payload fingerprint, kernel-side form): kept here by lowbit.kernels.weights.resolve
        self._resolved: tuple | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.format.decode(self.payload, self.shape, dtype)

    def lut_view(self) -> LutView:
        return self.format.lut_view(self.payload)

    def to(self, device: torch.device | str) -> QuantizedTensor:
        return QuantizedTensor(
            self.format, self.shape, {k: v.to(device) for k, v in self.payload.items()}
        )

    @property
    def device(self) -> torch.device:
        return next(iter(self.payload.values())).device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.payload.values())

    @property
    def bits_per_weight(self) -> float:
        return self.nbytes * 8 / math.prod(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: int | slice) -> QuantizedTensor:
        if len(self.shape) < 3:
            raise LowbitError(
                f"only a stacked weight [E, N, K] can be indexed by expert; this {self.format.name} "
                f"weight has shape {list(self.shape)}."
            )
        if isinstance(index, int) and not -self.shape[0] <= index < self.shape[0]:
            raise LowbitError(f"expert index {index} is out of range for {self.shape[0]} experts.")
        payload = {k: v[index] for k, v in self.payload.items()}
        lead = torch.empty(self.shape[0])[index].shape
        return QuantizedTensor(self.format, (*lead, *self.shape[1:]), payload)

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor({self.format.name}, shape={list(self.shape)}, "
            f"{self.bits_per_weight:.4f} bits/weight)"
        )
