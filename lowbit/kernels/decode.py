"""In-register decode shared by the dequantizing kernels (GEMV, GEMM, fused MoE).

Shape legend: BN rows of a weight tile, BK columns (codes along K), NC scale columns in the
tile, CH = BK / NC codes per scale column in the tile, B codes per scale in the payload.

Memory layout read (canonical, lowbit.formats.codes; one row = `stride_cn` bytes):
  4-bit: byte j holds code 2j (low nibble) and 2j+1 (high nibble);
  3-bit: code k sits at bits 3k .. 3k+2 of the row read as a little-endian bit stream
         (bytes 3g..3g+2 hold codes 8g..8g+7), so a code spans at most two bytes;
  fp8:   one float8_e4m3fn per code; dense: one bf16/fp16/fp32 per weight (the gemv reads
         bf16 only, as 32-bit words of two weights: the low half is column 2j).
Scales [.., N / SROWS, NB] with one scale per B codes along K (SROWS = 128 for fp8-block).
Invariant: B is a power of two and either B >= BK (one scale column per tile, BK | B) or
B < BK (BK / B whole blocks per tile); tiles start at multiples of BK.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.formats.views import DenseWeight, Fp8View, LutWeight
from lowbit.kernels.runtime import HAS_TRITON, tl, triton
from lowbit.kernels.weights import DECODE_E2M1, DECODE_FP8, SCALE_KIND_IDS

DECODE_DENSE = 4


@triton.jit
def unpack_codes(codes_ptr, row_off, rmask, k0, KC, BN: tl.constexpr, BK: tl.constexpr,
                 BITS: tl.constexpr):
    """int32 codes [BN, BK] of columns k0 .. k0+BK-1 (0 where masked). row_off: int64 [BN]."""
    if BITS == 4:
        j = k0 // 2 + tl.arange(0, BK // 2)  # byte index; masked in bytes so loads vectorize
        m = rmask[:, None] & (j < KC // 2)[None, :]
        b = tl.load(codes_ptr + row_off[:, None] + j[None, :], mask=m, other=0)
        b = b.to(tl.int32)
        c = tl.reshape(tl.join(b & 15, b >> 4), (BN, BK))
    else:
        k = k0 + tl.arange(0, BK)
        m = rmask[:, None] & (k < KC)[None, :]
        sh = (3 * k) & 7
        p = codes_ptr + row_off[:, None] + ((3 * k) >> 3)[None, :]
        lo = tl.load(p, mask=m, other=0).to(tl.int32)
        hi = tl.load(p + 1, mask=m & (sh > 5)[None, :], other=0).to(tl.int32)
        c = ((lo | (hi << 8)) >> sh[None, :]) & 7
    return c


@triton.jit
def code_values(c, table_ptr, tbase, DECODE: tl.constexpr, BITS: tl.constexpr):
    """float32 values of int32 codes c [BN, BK] before the per-table (alpha, beta).

    gather: table[tbase + c]; affine: 1 + c / 2**BITS (exact bit pattern);
    e2m1: the float16 with E2M1's bits placed in its sign/exponent/mantissa, = e2m1 * 2**-14.
    """
    if DECODE == 0:
        v = tl.load(table_ptr + tbase[:, None] + c)
    elif DECODE == 1:
        v = ((c << (23 - BITS)) | 0x3F800000).to(tl.float32, bitcast=True)
    else:
        h = ((c & 8) << 12) | ((c & 7) << 9)
        v = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return v


@triton.jit
def load_scales(ptr, row_off, col, mask, SCALE_KIND: tl.constexpr):
    """float32 scales [BN, NC] at row_off [BN] (elements) and column col [NC]; 0 where masked."""
    p = ptr + row_off[:, None] + col[None, :]
    if SCALE_KIND == 4:  # e8m0: 2**(b - 127); b = 0 -> 2**-127, b = 255 -> NaN
        b = tl.load(p, mask=mask, other=127).to(tl.int32)
        bits = tl.where(b == 0, 0x00400000, b << 23)
        bits = tl.where(b == 255, 0x7FC00000, bits)
        s = tl.where(mask, bits.to(tl.float32, bitcast=True), 0.0)
    else:  # no `other`: the interpreter cannot cast it to float8
        s = tl.where(mask, tl.load(p, mask=mask).to(tl.float32), 0.0)
    return s


@triton.jit
def raw_values(codes_ptr, table_ptr, row_off, tbase, rmask, k0, KC,
               BN: tl.constexpr, BK: tl.constexpr, BITS: tl.constexpr, DECODE: tl.constexpr):
    """float32 [BN, BK]: the code values before scales (fp8 / dense: the stored value)."""
    if DECODE >= 3:
        k = k0 + tl.arange(0, BK)
        m = rmask[:, None] & (k < KC)[None, :]
        v = tl.where(m, tl.load(codes_ptr + row_off[:, None] + k[None, :], mask=m).to(tl.float32), 0.0)
    else:
        c = unpack_codes(codes_ptr, row_off, rmask, k0, KC, BN, BK, BITS)
        v = code_values(c, table_ptr, tbase, DECODE, BITS)
    return v


@triton.jit
def row_tables(tidx_ptr, ab_ptr, rows, rmask, BN: tl.constexpr, HAS_TIDX: tl.constexpr,
               HAS_AB: tl.constexpr):
    """Per-row table index t (0 without HAS_TIDX; tidx_ptr already at the stack's rows) and
    the table's (alpha, beta) (1 and 0 without HAS_AB), each [BN]."""
    if HAS_TIDX:
        t = tl.load(tidx_ptr + rows, mask=rmask, other=0)
    else:
        t = tl.zeros([BN], tl.int32)
    if HAS_AB:
        alpha = tl.load(ab_ptr + 2 * t)
        beta = tl.load(ab_ptr + 2 * t + 1)
    else:
        alpha = tl.full([BN], 1.0, tl.float32)
        beta = tl.zeros([BN], tl.float32)
    return t, alpha, beta


@triton.jit
def dequant_tile(codes_ptr, table_ptr, scales_ptr, offs_ptr, row_off, tbase, alpha, beta,
                 srow_off, orow_off, rmask, k0, KC, g,
                 BN: tl.constexpr, BK: tl.constexpr, BITS: tl.constexpr, DECODE: tl.constexpr,
                 SCALE_KIND: tl.constexpr, B: tl.constexpr, HAS_AB: tl.constexpr,
                 HAS_OFFS: tl.constexpr):
    """float32 weights [BN, BK] = (alpha * value + beta) * scale * g + offset."""
    v = raw_values(codes_ptr, table_ptr, row_off, tbase, rmask, k0, KC, BN, BK, BITS, DECODE)
    if DECODE == 4:
        w = v
    else:
        if HAS_AB == 2:
            v = v * alpha[:, None] + beta[:, None]
        elif HAS_AB == 1:
            v = v * alpha[:, None]
        NC: tl.constexpr = BK // B if BK > B else 1
        CH: tl.constexpr = BK // NC
        col = (k0 + tl.arange(0, NC) * CH) // B
        # the last tile may start a block past the payload's end: its scale is 0, not a read
        smask = rmask[:, None] & (col < tl.cdiv(KC, B))[None, :]
        s = load_scales(scales_ptr, srow_off, col, smask, SCALE_KIND) * g
        w3 = tl.reshape(v, (BN, NC, CH)) * s[:, :, None]
        if HAS_OFFS:
            o = tl.load(offs_ptr + orow_off[:, None] + col[None, :], mask=smask, other=0)
            w3 = w3 + o.to(tl.float32)[:, :, None]
        w = tl.reshape(w3, (BN, BK))
    return w


@triton.jit
def lane_value(w, LANE: tl.constexpr, BITS: tl.constexpr, DECODE: tl.constexpr, table_ptr, tb,
               one_bits, ASM: tl.constexpr):
    """float32 value of code LANE of each 32-bit word in w (int32 [G, BN]).

    4-bit: code LANE at bits 4L..4L+3; 3-bit: bits 3L..3L+2 of a 24-bit group; fp8: byte L.
    affine: the float with exponent 0 and the code in the top mantissa bits,
    1 + c / 2**BITS, made by one shift and one LOP3 (one_bits = 0x3F800000 is a runtime
    argument so that ptxas folds the AND and the OR into one instruction).
    gather: table[tb + c]; on the GPU through `ld.global.nc` in inline asm, which keeps
    the tile's register layout (a plain gather load gets a layout of its own).
    """
    MASK: tl.constexpr = (1 << BITS) - 1
    if DECODE == 1:
        SH: tl.constexpr = 23 - BITS - BITS * LANE
        if SH >= 0:
            t = w << SH
        else:
            t = w >> (-SH)
        v = ((t & (MASK << (23 - BITS))) | one_bits).to(tl.float32, bitcast=True)
    elif DECODE == 2:
        SM: tl.constexpr = 9 - 4 * LANE
        SS: tl.constexpr = 12 - 4 * LANE
        if SM >= 0:
            tm = w << SM
        else:
            tm = w >> (-SM)
        if SS >= 0:
            ts = w << SS
        else:
            ts = w >> (-SS)
        h = (tm & 0xE00) | (ts & 0x8000)  # float16 bits: sign, exponent 0-3, one mantissa bit
        v = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    elif DECODE == 3:
        b = ((w >> (8 * LANE)) & 0xFF).to(tl.uint8)
        v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif DECODE == 4:  # dense bf16: weight LANE in the low (0) or high (1) half of the word
        if LANE == 0:
            v = (w << 16).to(tl.float32, bitcast=True)
        else:
            v = (w & -65536).to(tl.float32, bitcast=True)
    else:
        c = (w >> (BITS * LANE)) & MASK
        p = table_ptr + tb + c
        if ASM:
            v = tl.inline_asm_elementwise("ld.global.nc.f32 $0, [$1];", "=r,l", [p],
                                          dtype=tl.float32, is_pure=True, pack=1)
        else:
            v = tl.load(p)
    return v


# One 32-bit word of 8 E2M1 codes -> 8 float32 (times 2**-14), in PTX: per pair of codes
# (L, L + 4) two shifts, two logic ops (ptxas fuses them into LOP3s) and two cvt.f32.f16
# that read the float16 halves in place (HADD2.F32 with a half selector: no PRMT to
# extract them). The same bits as e2m1_pair; about 3 SASS instructions a weight.
_E2M1_WORD_PTX = """{
.reg .b32 t0, t1, t2, t3, s0, s1, s2, s3;
.reg .b16 l0, l1, l2, l3, h0, h1, h2, h3;
shl.b32 t0, $8, 9;
shl.b32 t1, $8, 5;
shl.b32 t2, $8, 1;
shr.u32 t3, $8, 3;
shl.b32 s0, $8, 12;
shl.b32 s1, $8, 8;
shl.b32 s2, $8, 4;
and.b32 s0, s0, 0x80008000;
and.b32 s1, s1, 0x80008000;
and.b32 s2, s2, 0x80008000;
and.b32 s3, $8, 0x80008000;
and.b32 t0, t0, 0x0E000E00;
and.b32 t1, t1, 0x0E000E00;
and.b32 t2, t2, 0x0E000E00;
and.b32 t3, t3, 0x0E000E00;
or.b32 t0, t0, s0;
or.b32 t1, t1, s1;
or.b32 t2, t2, s2;
or.b32 t3, t3, s3;
mov.b32 {l0, h0}, t0;
mov.b32 {l1, h1}, t1;
mov.b32 {l2, h2}, t2;
mov.b32 {l3, h3}, t3;
cvt.f32.f16 $0, l0;
cvt.f32.f16 $1, l1;
cvt.f32.f16 $2, l2;
cvt.f32.f16 $3, l3;
cvt.f32.f16 $4, h0;
cvt.f32.f16 $5, h1;
cvt.f32.f16 $6, h2;
cvt.f32.f16 $7, h3;
}"""
if HAS_TRITON:  # a jit function reads module globals only as constexprs
    _E2M1_WORD_PTX = tl.constexpr(_E2M1_WORD_PTX)


@triton.jit
def e2m1_word(w, ASM: tl.constexpr):
    """float32 values (times 2**-14) of the 8 E2M1 codes of each word in w: codes 0..7 (the
    nibbles from the lowest). ASM: the PTX above; otherwise e2m1_pair four times."""
    if ASM:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _E2M1_WORD_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32,
                   tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        v0, v4 = e2m1_pair(w, 0)
        v1, v5 = e2m1_pair(w, 1)
        v2, v6 = e2m1_pair(w, 2)
        v3, v7 = e2m1_pair(w, 3)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def e2m1_pair(w, LANE: tl.constexpr):
    """float32 values (times 2**-14) of E2M1 codes LANE and LANE + 4 of each word in w.

    The two codes sit 16 bits apart, so one shift puts both magnitudes (e1 e0 m) at bits
    9-11 and 25-27 and another both signs at bits 15 and 31: a float16 pair built with two
    shifts and two masks, then each half widened to float32 (exact, subnormals included).
    """
    u = w.to(tl.uint32, bitcast=True)
    SM: tl.constexpr = 9 - 4 * LANE
    SS: tl.constexpr = 12 - 4 * LANE
    if SM >= 0:
        tm = u << SM
    else:
        tm = u >> (-SM)
    ts = u << SS
    h2 = (tm & 0x0E000E00) | (ts & 0x80008000)
    lo = (h2 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (h2 >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def split_lanes(x, CPW: tl.constexpr):
    """x [G, CPW] -> CPW tensors [G] (column i = lane i); CPW is 2, 4 or 8 (the lanes past
    CPW repeat x0)."""
    G: tl.constexpr = x.shape[0]
    if CPW == 2:
        x0, x1 = tl.split(x)
        x2 = x0
        x3 = x0
        x4 = x0
        x5 = x0
        x6 = x0
        x7 = x0
    elif CPW == 8:
        e, o = tl.split(tl.reshape(x, (G, 2, 2, 2)))
        e0, e1 = tl.split(e)
        o0, o1 = tl.split(o)
        x0, x4 = tl.split(e0)
        x2, x6 = tl.split(e1)
        x1, x5 = tl.split(o0)
        x3, x7 = tl.split(o1)
    else:
        e, o = tl.split(tl.reshape(x, (G, 2, 2)))
        x0, x2 = tl.split(e)
        x1, x3 = tl.split(o)
        x4 = x0
        x5 = x0
        x6 = x0
        x7 = x0
    return x0, x1, x2, x3, x4, x5, x6, x7


# Four bytes (8 E2M1 codes) -> 8 bfloat16 in four bf16x2 registers, for pack=4 over a uint8
# tile: $0 / $1 the low nibbles of bytes (0, 1) / (2, 3), $2 / $3 the high nibbles. Each code's
# sign goes to bit 15 and its magnitude bits (e1 e0 m) to bits 8..6: the bf16 exponent's two
# low bits and the first mantissa bit, so the value is e2m1 * 2**-126 (code 1, 0.5, lands on
# the subnormal 2**-127; the scale multiply after it is exact). One PRMT per two bytes spreads
# them into the halves, then per bf16x2 one shift pair and two LOP3s: about 2.3 SASS
# instructions a weight, where the float32 chain (code_values, then scale, then pack) took 10.
def _nibbles_to_bf16(dst: str, src: str, mag_shift: int, sign_shift: int) -> str:
    """PTX: the nibbles at bits 0-3 (mag_shift 6, sign_shift 12) or 4-7 (2, 8) of each
    16-bit half of src as bf16 bits in dst: magnitude to bits 8..6, sign to bit 15."""
    return (f"shl.b32 a, {src}, {mag_shift};\nshl.b32 b, {src}, {sign_shift};\n"
            f"and.b32 a, a, 0x01C001C0;\nand.b32 b, b, 0x80008000;\nor.b32 {dst}, a, b;\n")


_E2M1_BYTES_BF16_PTX = ("{\n.reg .b32 x, y, a, b;\nprmt.b32 x, $4, 0, 0x4140;\nprmt.b32 y, $4, 0, 0x4342;\n"
                        + _nibbles_to_bf16("$0", "x", 6, 12) + _nibbles_to_bf16("$1", "y", 6, 12)
                        + _nibbles_to_bf16("$2", "x", 2, 8) + _nibbles_to_bf16("$3", "y", 2, 8) + "}")
if HAS_TRITON:
    _E2M1_BYTES_BF16_PTX = tl.constexpr(_E2M1_BYTES_BF16_PTX)

# e2m1_tile_bf16's weights are e2m1 * scale * 2**-8; the caller multiplies its accumulator's
# column n by alpha[n] * g * E2M1_BF16_POST (alpha = unit * 2**14, see weights.DECODE_E2M1)
E2M1_BF16_POST = 2.0**-6
E2M1_BF16_POST_C = tl.constexpr(E2M1_BF16_POST) if HAS_TRITON else E2M1_BF16_POST


@triton.jit
def e2m1_tile_bf16(codes_ptr, scales_ptr, row_off, srow_off, rmask, k0, KC,
                   BN: tl.constexpr, BK: tl.constexpr, B: tl.constexpr,
                   SCALE_KIND: tl.constexpr, ASM: tl.constexpr):
    """bfloat16 weights [BN, BK] = e2m1 * scale * 2**-8 of an E2M1 tile with e4m3 scales,
    exact (a 2-bit by 4-bit significand product; 0.5 * 2**-9 * 2**-8 is a normal bf16). The
    per-row alpha * g is not applied: see E2M1_BF16_POST.
    ASM: the PTX above, then the scale (widened once per block, times 2**118 <= 448 * 2**118
    < 2**127) multiplies the bf16x2 pairs. Otherwise (the interpreter, whose bf16 arithmetic
    is not IEEE) the same values through float32."""
    j = k0 // 2 + tl.arange(0, BK // 2)
    m = rmask[:, None] & (j < KC // 2)[None, :]
    b = tl.load(codes_ptr + row_off[:, None] + j[None, :], mask=m, other=0)
    NC: tl.constexpr = BK // B if BK > B else 1
    CH: tl.constexpr = BK // NC
    col = (k0 + tl.arange(0, NC) * CH) // B
    smask = rmask[:, None] & (col < tl.cdiv(KC, B))[None, :]
    s = load_scales(scales_ptr, srow_off, col, smask, SCALE_KIND)
    if ASM:
        s = (s * 3.32306998946229e+35).to(tl.bfloat16)  # 2**118
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, NC, CH // 2)), (BN, BK // 2))
        lo, hi = tl.inline_asm_elementwise(
            _E2M1_BYTES_BF16_PTX, "=r,=r,=r,=r,r", [b], dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True, pack=4)
        w = tl.reshape(tl.join(lo * s, hi * s), (BN, BK))
    else:
        c = b.to(tl.int32)
        v = tl.reshape(tl.join(c & 15, c >> 4), (BN, BK))
        v = code_values(v, c, c, 2, 4)  # e2m1 * 2**-14
        w3 = tl.reshape(v, (BN, NC, CH)) * (s * 64.0)[:, :, None]
        w = tl.reshape(w3, (BN, BK)).to(tl.bfloat16)
    return w


@triton.jit
def dot_tile(codes_ptr, table_ptr, scales_ptr, offs_ptr, row_off, tbase, alpha, beta,
             srow_off, orow_off, rmask, k0, KC, g,
             BN: tl.constexpr, BK: tl.constexpr, BITS: tl.constexpr, DECODE: tl.constexpr,
             SCALE_KIND: tl.constexpr, B: tl.constexpr, HAS_AB: tl.constexpr,
             HAS_OFFS: tl.constexpr, E2M1_BF16: tl.constexpr, ASM: tl.constexpr):
    """The [BN, BK] weight tile a tensor-core kernel feeds tl.dot: E2M1_BF16 (e2m1_bf16 on
    the host), the exact bf16 tile without alpha * g, which dot_tile_post then applies to
    the accumulator; else dequant_tile's float32 weights."""
    if E2M1_BF16:
        w = e2m1_tile_bf16(codes_ptr, scales_ptr, row_off, srow_off, rmask, k0, KC, BN, BK, B,
                           SCALE_KIND, ASM)
    else:
        w = dequant_tile(codes_ptr, table_ptr, scales_ptr, offs_ptr, row_off, tbase, alpha,
                         beta, srow_off, orow_off, rmask, k0, KC, g, BN, BK, BITS, DECODE,
                         SCALE_KIND, B, HAS_AB, HAS_OFFS)
    return w


@triton.jit
def dot_tile_post(acc, alpha, g, E2M1_BF16: tl.constexpr):
    """acc [BM, BN] of dot_tile weights, its columns times alpha * g where the tiles left it out."""
    if E2M1_BF16:
        acc = acc * (alpha * (g * E2M1_BF16_POST_C))[None, :]
    return acc


@dataclass
class WeightArgs:
    """Kernel arguments of one (possibly stacked) weight; the stride_*e are per leading index."""

    codes: torch.Tensor
    table: torch.Tensor
    tidx: torch.Tensor
    ab: torch.Tensor
    scales: torch.Tensor
    offs: torch.Tensor
    kc: int
    stride_ce: int
    stride_cn: int
    stride_te: int
    stride_se: int
    stride_sn: int
    stride_oe: int
    stride_on: int
    g: float
    bits: int
    decode: int
    scale_kind: int
    block: int
    srows: int
    has_tidx: bool
    has_ab: int  # 0: no (alpha, beta); 1: alpha only (beta is 0: E2M1); 2: both
    has_offs: bool

    def constexprs(self) -> dict:
        return dict(BITS=self.bits, DECODE=self.decode, SCALE_KIND=self.scale_kind, B=self.block,
                    SROWS=self.srows, HAS_TIDX=self.has_tidx, HAS_AB=self.has_ab,
                    HAS_OFFS=self.has_offs)


def _stride(t: torch.Tensor, dim: int) -> int:
    return t.stride(dim) if t.dim() >= -dim else 0


def e2m1_bf16(a: WeightArgs) -> bool:
    """Whether a tile kernel decodes these weights with e2m1_tile_bf16: 4-bit E2M1 codes with
    e4m3 block scales (nvfp4), no offsets."""
    return (a.decode == DECODE_E2M1 and a.bits == 4 and a.has_ab == 1 and not a.has_offs
            and a.scale_kind == SCALE_KIND_IDS["e4m3"])


def exact_tiles(w) -> bool:
    """Whether the tile kernels (lut_gemm, fused_moe) feed tl.dot this weight unrounded: the
    e2m1_tile_bf16 tiles are exact and alpha * g multiplies the float32 accumulator. The
    twins (reference_linear / reference_moe with dot_dtype) then skip the weight rounding."""
    return isinstance(w, LutWeight) and e2m1_bf16(weight_args(w))


def ab_kind(w: LutWeight) -> int:
    """HAS_AB: 0 without per-table (alpha, beta); 1 when beta is 0 by construction (the E2M1
    decode: the kernels skip its terms); 2 otherwise."""
    if w.alpha_beta is None:
        return 0
    return 1 if w.decode == DECODE_E2M1 else 2


def weight_args(w: LutWeight | Fp8View | DenseWeight) -> WeightArgs:
    """Pointers, strides and constexprs for w of shape [N, K] or [E, N, K]."""
    if isinstance(w, LutWeight):
        v = w.view
        assert v.codes.dtype == torch.uint8 and v.codes.stride(-1) == 1
        assert v.scales.stride(-1) == 1 and v.table.is_contiguous()
        assert v.block_size & (v.block_size - 1) == 0, "LUT blocks are powers of two"
        tidx = v.table_index
        offs = v.offsets
        return WeightArgs(
            codes=v.codes, table=v.table, tidx=v.codes if tidx is None else tidx,
            ab=v.table if w.alpha_beta is None else w.alpha_beta, scales=v.scales,
            offs=v.scales if offs is None else offs, kc=w.kp,
            stride_ce=_stride(v.codes, -3), stride_cn=v.codes.stride(-2),
            stride_te=0 if tidx is None else _stride(tidx, -2),
            stride_se=_stride(v.scales, -3), stride_sn=v.scales.stride(-2),
            stride_oe=0 if offs is None else _stride(offs, -3),
            stride_on=0 if offs is None else offs.stride(-2),
            g=float(v.global_scale), bits=v.bits, decode=w.decode,
            scale_kind=SCALE_KIND_IDS[v.scale_kind], block=v.block_size, srows=1,
            has_tidx=tidx is not None, has_ab=ab_kind(w), has_offs=offs is not None,
        )
    if isinstance(w, Fp8View):
        assert w.codes.stride(-1) == 1 and w.scales.stride(-1) == 1
        block = w.block_cols if w.block_cols & (w.block_cols - 1) == 0 else 1 << 30
        if w.scales.shape[-1] != 1:
            assert block == w.block_cols, "fp8 scale blocks along K are powers of two"
        codes = w.codes
        return WeightArgs(
            codes=codes, table=w.scales, tidx=w.scales, ab=w.scales, scales=w.scales,
            offs=w.scales, kc=w.kp, stride_ce=_stride(codes, -3), stride_cn=codes.stride(-2),
            stride_te=0, stride_se=_stride(w.scales, -3), stride_sn=w.scales.stride(-2),
            stride_oe=0, stride_on=0, g=1.0, bits=8, decode=DECODE_FP8,
            scale_kind=SCALE_KIND_IDS[w.scale_kind], block=block, srows=w.block_rows,
            has_tidx=False, has_ab=False, has_offs=False,
        )
    t = w.w
    assert t.stride(-1) == 1
    return WeightArgs(
        codes=t, table=t, tidx=t, ab=t, scales=t, offs=t, kc=w.kp,
        stride_ce=_stride(t, -3), stride_cn=t.stride(-2), stride_te=0, stride_se=0, stride_sn=0,
        stride_oe=0, stride_on=0, g=1.0, bits=16, decode=DECODE_DENSE, scale_kind=0,
        block=1 << 30, srows=1, has_tidx=False, has_ab=False, has_offs=False,
    )


def dot_dtype(x_dtype: torch.dtype):
    """Operand type of tl.dot for activations of x_dtype (fp16 stays fp16, else bf16)."""
    return tl.float16 if x_dtype == torch.float16 else tl.bfloat16


__all__ = ["triton", "DECODE_DENSE", "WeightArgs", "weight_args", "dot_dtype"]
