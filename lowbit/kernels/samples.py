"""Random instances of the payloads the kernels read, for tests and benchmarks.

Shape legend: L leading dims, N rows, K logical columns, B codes per scale,
NB = ceil(K / B), Kp = NB * B. Values are drawn fresh (never zeros) so an unwritten
output or a wrong index shows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit.formats.base import LutView
from lowbit.formats.codes import e2m1_table
from lowbit.formats.nf import NF3_TABLE, NF4_TABLE
from lowbit.formats.views import Fp8View

TABLES = ("random", "e2m1", "int", "nf")

# The weights the benchmark and the tuner time: N x K shapes and random_lut_view arguments
# that mimic each format's table, block and scale encoding.
BENCH_SHAPES = ((4096, 14336), (14336, 4096), (2048, 6144))
BENCH_LUT_FORMATS = {
    "int4_g128": dict(bits=4, table="int", block_size=128, scale_kind="f16", offsets=True),
    "nvfp4": dict(bits=4, table="e2m1", block_size=16, scale_kind="e4m3"),
    "mxfp4": dict(bits=4, table="e2m1", block_size=32, scale_kind="e8m0"),
    "nf4": dict(bits=4, table="nf", block_size=64, scale_kind="bf16"),
    "lut3": dict(bits=3, table="random", block_size=64, scale_kind="bf16", tables=4),
}
SCALE_DTYPES = {
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f32": torch.float32,
    "e4m3": torch.float8_e4m3fn,
    "e8m0": torch.uint8,
}


def _table(kind: str, bits: int, tables: int, gen: torch.Generator) -> Tensor:
    size = 1 << bits
    if kind == "random":
        return torch.randn(tables, size, generator=gen).sort(-1).values
    if kind == "e2m1":
        assert bits == 4, "E2M1 has 4-bit codes"
        mult = torch.rand(tables, 1, generator=gen) + 0.5
        return e2m1_table()[None] * mult
    if kind == "int":
        return torch.arange(size, dtype=torch.float32)[None].expand(tables, size).clone()
    if kind == "nf":
        base = torch.tensor(NF4_TABLE if bits == 4 else NF3_TABLE, dtype=torch.float32)
        return base[None].expand(tables, size).clone()
    raise AssertionError(f"table kind {kind} not in {TABLES}")


def _scales(shape: tuple[int, ...], kind: str, gen: torch.Generator) -> Tensor:
    if kind == "e8m0":
        return torch.randint(122, 131, shape, generator=gen).to(torch.uint8)
    s = torch.rand(shape, generator=gen) * 1.5 + 0.25
    if torch.rand((), generator=gen) < 0.5:  # some negative scales: the kernels must not assume a sign
        s = s * torch.where(torch.rand(shape, generator=gen) < 0.1, -1.0, 1.0)
    return s.to(SCALE_DTYPES[kind])


def random_lut_view(
    n: int,
    k: int,
    *,
    bits: int = 4,
    block_size: int = 32,
    scale_kind: str = "bf16",
    table: str = "random",
    tables: int = 1,
    offsets: bool = False,
    global_scale: float = 1.0,
    lead: tuple[int, ...] = (),
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> LutView:
    """A LutView of shape [*lead, N, K] in the canonical layout (codes for Kp columns)."""
    gen = torch.Generator().manual_seed(seed)
    nb = -(-k // block_size)
    kp = nb * block_size
    # every byte string is a valid packing of random codes: draw the packed bytes directly,
    # on the target device (real-size expert stacks are hundreds of MB)
    dgen = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, 256, (*lead, n, kp * bits // 8), generator=dgen, device=device,
                          dtype=torch.uint8)
    tab = _table(table, bits, tables, gen)
    index = None
    if tables > 1:
        index = torch.randint(0, tables, (*lead, n), generator=gen).to(torch.int32)
    offs = None
    if offsets:
        offs = (torch.randn(*lead, n, nb, generator=gen) * 0.1).to(torch.float16)
    view = LutView(
        codes=codes,
        bits=bits,
        block_size=block_size,
        table=tab,
        table_index=index,
        scales=_scales((*lead, n, nb), scale_kind, gen),
        scale_kind=scale_kind,
        global_scale=global_scale,
        offsets=offs,
    )
    return to_device(view, device)


def to_device(view: LutView, device: torch.device | str) -> LutView:
    def move(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(device)

    return LutView(
        codes=move(view.codes),
        bits=view.bits,
        block_size=view.block_size,
        table=move(view.table),
        table_index=move(view.table_index),
        scales=move(view.scales),
        scale_kind=view.scale_kind,
        global_scale=view.global_scale,
        offsets=move(view.offsets),
    )


def random_fp8_view(
    n: int,
    k: int,
    *,
    layout: str = "channel",
    lead: tuple[int, ...] = (),
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> Fp8View:
    """layout: "channel" (f32 [.., N, 1]), "block" (f32 128x128), "mx" (e8m0 per 32)."""
    gen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator(device=device).manual_seed(seed)
    codes = (torch.randn(*lead, n, k, generator=dgen, device=device) * 64).to(torch.float8_e4m3fn)
    if layout == "channel":
        view = Fp8View(codes, torch.rand(*lead, n, 1, generator=gen) * 0.02 + 0.001, "f32", 1, k)
    elif layout == "block":
        shape = (*lead, -(-n // 128), -(-k // 128))
        view = Fp8View(codes, torch.rand(shape, generator=gen) * 0.02 + 0.001, "f32", 128, 128)
    elif layout == "mx":
        shape = (*lead, n, -(-k // 32))
        view = Fp8View(codes, torch.randint(118, 124, shape, generator=gen).to(torch.uint8), "e8m0", 1, 32)
    else:
        raise AssertionError(f"fp8 layout {layout} not in channel, block, mx")
    return Fp8View(view.codes.to(device), view.scales.to(device), view.scale_kind,
                   view.block_rows, view.block_cols)
