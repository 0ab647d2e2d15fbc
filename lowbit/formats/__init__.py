"""Weight formats: one file per family, the registry, and the containers the kernels read
(the LUT view in base.py, views.py, hybrid.py).

docs/FORMATS.md is the normative spec; tests/vectors/ holds its conformance vectors.
"""

from __future__ import annotations

from lowbit.errors import LowbitError
from lowbit.formats.base import Format, LutView, QuantizedTensor, lut_view_decode
from lowbit.formats.fp8 import Fp8BlockFormat, Fp8Format
from lowbit.formats.int4 import Int4Format
from lowbit.formats.lut import LutFormat
from lowbit.formats.mx import Mxfp4Format, Mxfp8Format
from lowbit.formats.nf import NF3_TABLE, NF4_TABLE, NormalFloatFormat
from lowbit.formats.nvfp4 import Nvfp4Format
from lowbit.formats.vq import VQ_FORMATS, VqFormat

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Fp8Format(),
        Fp8BlockFormat(),
        Nvfp4Format(),
        Mxfp4Format(),
        Mxfp8Format(),
        NormalFloatFormat("nf4", 4, NF4_TABLE),
        NormalFloatFormat("nf3", 3, NF3_TABLE),
        Int4Format(128),
        Int4Format(64),
        Int4Format(32),
        LutFormat("lut4", 4),
        LutFormat("lut3", 3),
        *VQ_FORMATS,
    )
}

# Formats with a LUT view (3- and 4-bit codes into a table, times a block scale).
SCALAR_FORMATS = ("nvfp4", "mxfp4", "nf4", "nf3", "int4", "int4-g64", "int4-g32", "lut4", "lut3")
# Vector codebook formats (groups of weights index a fixed codebook; lowbit.formats.vq).
VQ_FORMAT_NAMES = tuple(f.name for f in VQ_FORMATS)


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise LowbitError(
            f"unknown weight format {name!r}; known formats: {', '.join(FORMATS)}."
        ) from None


__all__ = [
    "FORMATS",
    "SCALAR_FORMATS",
    "VQ_FORMAT_NAMES",
    "VqFormat",
    "Format",
    "LutView",
    "QuantizedTensor",
    "get_format",
    "lut_view_decode",
]
