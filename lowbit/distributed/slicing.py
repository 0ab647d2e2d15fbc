"""Cutting a weight into the piece one rank holds: dense tensors and QuantizedTensors alike.

A sharded parameter carries a `ShardSpec`: its logical (unsharded) shape, an optional
`Split` of one dim into equal parts, an optional range of experts on dim 0, and `zero`
for the ranks that hold zeros (the bias of a K-split layer is added by rank 0 only).
`take(x, spec)` cuts a whole logical tensor; `take_piece(x, spec, half)` cuts one
expert's piece as checkpoints store it (no expert dim; `half` 0/1 for the gate/up rows of
a w13 stack, None for a whole expert).

QuantizedTensors: logical shape [L.., N, K]; every payload tensor is laid out from it
(format.payload_spec). Cutting a leading dim cuts every payload alike. Cutting N or K
cuts, in each payload tensor, the dims whose size follows that logical dim; a cut point
x must be a block boundary of each of them: one more weight past x would need a new
payload element (f(x + 1) > f(x), f = that payload dim's size as a function of the
logical size). Anything else is refused with the tensor's name and the sizes. Payloads
that do not follow the cut dim (a global scale, a shared table) are kept whole; a
`table_index` is rebased when its `table` is cut.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lowbit.errors import LowbitError
from lowbit.formats.base import QuantizedTensor

_REBASE = {"table_index": "table"}  # payload whose values index rows of another payload


@dataclass(frozen=True)
class Split:
    """This rank holds part `index` of `parts` equal parts of `dim`."""

    dim: int
    index: int
    parts: int
    halves: bool = False  # the dim is [gate rows; up rows]: each half is split alike
    padded: int | None = None  # zero-pad the dim to this size first (the vocabulary)


@dataclass(frozen=True)
class ShardSpec:
    logical: tuple[int, ...]
    split: Split | None = None
    experts: tuple[int, int] | None = None  # (first, count) of the experts on dim 0
    zero: bool = False

    @property
    def local(self) -> tuple[int, ...]:
        shape = list(self.logical)
        if self.experts is not None:
            shape[0] = self.experts[1]
        if self.split is not None:
            s = self.split
            shape[s.dim] = (s.padded or shape[s.dim]) // s.parts
        return tuple(shape)


def take(x, spec: ShardSpec, name: str):
    """This rank's part of the whole logical tensor x (dense or quantized)."""
    _check(name, spec.logical, tuple(x.shape))
    if spec.experts is not None:
        x = narrow(x, 0, spec.experts[0], spec.experts[1], name)
    if spec.split is not None:
        x = _split(x, spec.split, name)
    return _zeros(x) if spec.zero else x


def take_piece(x, spec: ShardSpec, half: int | None, name: str):
    """This rank's part of one expert's piece: [2I, D] rows of w13 (or the gate/up half
    [I, D] when `half` is set), [D, I] of w2, and so on: the logical shape without dim 0."""
    s = spec.split
    if s is not None:
        s = replace(s, dim=(s.dim % len(spec.logical)) - 1, halves=s.halves and half is None)
    if s is not None and s.dim >= 0:
        x = _split(x, s, name)
    return _zeros(x) if spec.zero else x


def _split(x, s: Split, name: str):
    size = x.shape[s.dim]
    if s.padded is not None and s.padded != size:
        x = _pad(x, s.dim, s.padded, name)
        size = s.padded
    if not s.halves:
        part = _part(size, s.parts, name, x.shape, s.dim)
        return narrow(x, s.dim, s.index * part, part, name)
    half = _part(size, 2, name, x.shape, s.dim)
    part = _part(half, s.parts, name, x.shape, s.dim)
    lo = s.index * part
    return cat([narrow(x, s.dim, lo, part, name), narrow(x, s.dim, half + lo, part, name)], s.dim, name)


def _part(size: int, parts: int, name: str, shape, dim: int) -> int:
    if size % parts:
        raise LowbitError(
            f"cannot split {name!r} (shape {list(shape)}) into {parts} equal parts along dim {dim}: "
            f"{size} is not divisible by {parts}; pick a parallel size that divides it")
    return size // parts


def _check(name: str, want: tuple, got: tuple) -> None:
    if tuple(want) != tuple(got):
        raise LowbitError(
            f"tensor {name!r} has shape {list(got)} in the checkpoint but the model expects "
            f"{list(want)} before sharding; the checkpoint does not match config.json")


def _zeros(x):
    if isinstance(x, QuantizedTensor):
        raise AssertionError("a zeroed shard is a bias, never a quantized weight")
    return torch.zeros_like(x)


def _pad(x, dim: int, size: int, name: str):
    if isinstance(x, QuantizedTensor):
        raise LowbitError(f"{name!r} is quantized and its {x.shape[dim]} rows do not split evenly; "
                          "keep it dense or pick a tensor parallel size that divides them")
    pad = list(x.shape)
    pad[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_zeros(pad)], dim)


# -- narrow / cat for dense and quantized -----------------------------------------------------
def narrow(x, dim: int, start: int, length: int, name: str):
    """x[..., start:start+length, ...] along dim, as its own contiguous copy."""
    if not isinstance(x, QuantizedTensor):
        return x.narrow(dim, start, length).contiguous()
    dim %= len(x.shape)
    if dim < len(x.shape) - 2:  # a leading (expert) dim: every payload starts with it
        payload = {k: v.narrow(dim, start, length).contiguous() for k, v in x.payload.items()}
        shape = list(x.shape)
        shape[dim] = length
        return QuantizedTensor(x.format, tuple(shape), payload)
    return _narrow_blocks(x, dim, start, length, name)


def _sized(shape: tuple, dim: int, n: int) -> tuple:
    return tuple(n if i == dim else s for i, s in enumerate(shape))


def _narrow_blocks(x: QuantizedTensor, dim: int, start: int, length: int, name: str) -> QuantizedTensor:
    fmt, shape = x.format, x.shape
    full = fmt.payload_spec(shape)

    def size_of(key: str, pdim: int, n: int) -> int:  # payload dim size for a logical size n
        return 0 if n == 0 else fmt.payload_spec(_sized(shape, dim, n))[key][0][pdim]

    indexed = {table: idx for idx, table in _REBASE.items() if idx in x.payload and table in x.payload}
    payload = {}
    for key, t in x.payload.items():
        if key in indexed:
            continue  # cut below, by the rows its index payload points at
        spec_dims = full[key][0]
        # dims whose size follows the cut dim; one that does not change kept a single block
        # (or a per-matrix value): every shard reads it whole
        follows = [j for j in range(len(spec_dims)) if size_of(key, j, length) != spec_dims[j]]
        for j in follows:
            for point in (start, start + length):
                if 0 < point < shape[dim] and size_of(key, j, point + 1) == size_of(key, j, point):
                    raise LowbitError(
                        f"cannot shard {name!r}: {fmt.name} weight {list(shape)} would be cut at "
                        f"{'N' if dim == len(shape) - 2 else 'K'} = {point}, inside a block of its "
                        f"{key!r} payload; the per-rank size {length} must be a multiple of the block")
            lo, hi = size_of(key, j, start), size_of(key, j, start + length)
            t = t.narrow(j, lo, hi - lo)
        payload[key] = t.contiguous()
    for table, idx in indexed.items():
        payload[table], payload[idx] = _cut_indexed(x.payload[table], payload[idx], full[table][0],
                                                    fmt.payload_spec(_sized(shape, dim, length))[table][0], name)
    try:
        return QuantizedTensor(fmt, _sized(shape, dim, length), payload)
    except LowbitError as e:
        raise LowbitError(f"cannot shard {name!r} along dim {dim} to {length}: {e}") from None


def _cut_indexed(table: torch.Tensor, index: torch.Tensor, whole: tuple, want: tuple, name: str):
    """Keep the tables the shard's rows point at (a contiguous run), indices rebased."""
    dims = [j for j, (a, b) in enumerate(zip(whole, want)) if a != b]
    if not dims:
        return table, index
    lo = int(index.min())
    n = want[dims[0]]
    if int(index.max()) >= lo + n:
        raise LowbitError(f"cannot shard {name!r}: its rows use tables {lo}..{int(index.max())}, more than "
                          f"the {n} a shard of that size holds; pick a parallel size whose row split "
                          "falls on the format's row groups")
    return table.narrow(dims[0], lo, n).contiguous(), index - lo


def cat(xs: list, dim: int, name: str):
    """Concatenate along dim; quantized pieces must share every payload that does not
    follow that dim (one global scale for both halves of a gate/up stack)."""
    if not isinstance(xs[0], QuantizedTensor):
        return torch.cat(xs, dim)
    fmt, shape = xs[0].format, xs[0].shape
    dim %= len(shape)
    total = sum(x.shape[dim] for x in xs)
    full = fmt.payload_spec(_sized(shape, dim, total))
    payload = {}
    for key, (spec, _) in full.items():
        parts = [x.payload[key] for x in xs]
        grown = [j for j, s in enumerate(spec) if s != parts[0].shape[j]]
        if not grown:
            if any(not torch.equal(p, parts[0]) for p in parts[1:]):
                raise LowbitError(f"cannot join the pieces of {name!r}: their {key!r} payloads differ")
            payload[key] = parts[0]
        else:
            payload[key] = torch.cat(parts, grown[0])
    for idx, table in _REBASE.items():  # joined rows: each piece's indices count from its own tables
        if dim == len(shape) - 2 and idx in payload and payload[table].shape != xs[0].payload[table].shape:
            tdim = [j for j, s in enumerate(payload[table].shape) if s != xs[0].payload[table].shape[j]][0]
            offsets = [0]
            for x in xs[:-1]:
                offsets.append(offsets[-1] + x.payload[table].shape[tdim])
            payload[idx] = torch.cat([x.payload[idx] + o for x, o in zip(xs, offsets)], dim)
    try:
        return QuantizedTensor(fmt, _sized(shape, dim, total), payload)
    except LowbitError as e:  # e.g. more lut tables than rows of the joined size may hold
        raise LowbitError(f"cannot join the pieces of {name!r}: {e}") from None
