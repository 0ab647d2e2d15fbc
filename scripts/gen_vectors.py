"""Write the conformance vectors of docs/FORMATS.md to tests/vectors/<format>.json.

    python scripts/gen_vectors.py            # rewrite every file
    python scripts/gen_vectors.py nvfp4 int4 # only these formats

Each case holds the input (float32 values as C99 hex floats, row-major, plus the dtype it
is cast to before encoding; the cast is exact), the payload (dtype, shape, raw
little-endian bytes as hex) and the decoded float32 values (hex floats).  A case with
"error" instead expects encoding to raise LowbitError.  lut4 / lut3 cases list
"encode_with": ["table"]: the encoder is given the payload's table rather than fitting one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from lowbit.errors import LowbitError
from lowbit.formats import FORMATS, get_format
from lowbit.formats.nf import NF3_TABLE, NF4_TABLE

OUT = Path(__file__).resolve().parent.parent / "tests" / "vectors"
F32_MAX = torch.finfo(torch.float32).max
TINY = 2.0**-140  # a float32 subnormal


def fhex(v: float) -> str:
    """Shortest C99 hex float: '0x1.8p+1', '-0x0p+0', 'nan', 'inf'."""
    h = float.hex(v)
    if "p" not in h:
        return h
    mant, exp = h.split("p")
    return mant.rstrip("0").rstrip(".") + "p" + exp


def hexes(t: torch.Tensor) -> list[str]:
    return [fhex(v) for v in t.float().reshape(-1).tolist()]


def raw(t: torch.Tensor) -> dict:
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "hex": data.hex()}


def gaussian(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def case(fmt: str, name: str, w: torch.Tensor, dtype: torch.dtype = torch.float32, **kw) -> dict:
    x = w.to(dtype)
    assert torch.equal(x.float(), w) or not torch.isfinite(w).all(), f"{name}: cast not exact"
    out = {"name": name, "shape": list(w.shape), "input_dtype": str(dtype)[6:], "input": hexes(w)}
    f = get_format(fmt)
    try:
        payload = f.encode(x, **kw)
    except LowbitError as e:
        return {**out, "error": "LowbitError", "message": str(e)}
    if kw:
        out["encode_with"] = sorted(kw)
    out["payload"] = {k: raw(v) for k, v in payload.items()}
    out["decoded"] = hexes(f.decode(payload, tuple(w.shape)))
    return out


def refusals(fmt: str, k: int = 8) -> list[dict]:
    row = torch.linspace(-1, 1, k)
    nan, inf = row.clone(), row.clone()
    nan[3] = float("nan")
    inf[k - 1] = float("-inf")
    return [
        case(fmt, "NaN input is refused", nan[None]),
        case(fmt, "-Inf input is refused", inf[None]),
    ]


def common(fmt: str, k: int) -> list[dict]:
    """Cases every format gets; k is a block length along K."""
    zeros_and_data = torch.stack([torch.zeros(k), gaussian((k,), 1)])
    return [
        case(fmt, "all zeros", torch.zeros(1, k)),
        case(fmt, "a zero row or block next to data", zeros_and_data),
        case(fmt, "gaussian, K not a multiple of the block", gaussian((2, k + 5), 2)),
        case(
            fmt, "gaussian bfloat16 input", gaussian((1, k), 3).bfloat16().float(), torch.bfloat16
        ),
        case(fmt, "gaussian float16 input", gaussian((1, k), 4).half().float(), torch.float16),
        case(fmt, "stacked experts [2, 1, K]", gaussian((2, 1, k), 5)),
        case(fmt, "float32 subnormals only", torch.full((1, k), TINY) * torch.arange(k) / k),
        case(fmt, "+-float32 max", torch.tensor([[F32_MAX, -F32_MAX] * (k // 2)])),
        *refusals(fmt),
    ]


def fp8_ties() -> torch.Tensor:
    """Row with amax 448 (scale 1): E4M3 midpoints, subnormals and saturation."""
    vals = [448.0, -448.0, 1.0625, 1.1875, -1.0625, 432.0, 2.0**-10, 3 * 2.0**-10, 2.0**-9, 0.0]
    vals += [2.0**-7 * 1.0625, 15.5, 240.0, 248.0, -0.001, 1.0]
    return torch.tensor([vals])


def fp8_cases() -> list[dict]:
    return common("fp8", 16) + [case("fp8", "E4M3 ties, subnormals, max", fp8_ties())]


def fp8_block_cases() -> list[dict]:
    ties = torch.nn.functional.pad(fp8_ties(), (0, 0, 0, 1))
    return [
        case("fp8-block", "one partial tile [3, 5]", gaussian((3, 5), 6)),
        case("fp8-block", "two tiles along K [1, 130]", gaussian((1, 130), 7)),
        case("fp8-block", "two tiles along N [130, 1]", gaussian((130, 1), 8)),
        case("fp8-block", "E4M3 ties in one tile", ties),
        case(
            "fp8-block",
            "a zero tile next to data",
            torch.cat([torch.zeros(1, 128), gaussian((1, 3), 9)], 1),
        ),
        case("fp8-block", "all zeros", torch.zeros(2, 3)),
        case("fp8-block", "stacked experts [2, 2, 3]", gaussian((2, 2, 3), 10)),
        case("fp8-block", "float32 subnormals only", torch.full((1, 4), TINY)),
        case("fp8-block", "+-float32 max", torch.tensor([[F32_MAX, -F32_MAX, 1.0]])),
        *refusals("fp8-block"),
    ]


def e2m1_tie_block() -> list[float]:
    """Amax 6: every E2M1 midpoint, both signs, and the values themselves."""
    return [
        6.0,
        5.0,
        3.5,
        2.5,
        1.75,
        1.25,
        0.75,
        0.25,
        -0.25,
        -5.0,
        -1.75,
        4.0,
        -0.5,
        0.1,
        -0.1,
        0.0,
    ]


def nvfp4_cases() -> list[dict]:
    # Matrix amax 2688 -> g = 1: block 0 has scale 448, block 1 scale 1 (ties exact),
    # block 2 saturates (6.36 / 6 rounds down to scale 1), block 3 has an E4M3 subnormal scale.
    top = [2688.0, -1344.0] + [0.0] * 14
    sat = [6.36, -6.2] + [1.0] * 14
    sub = [6 * 2.0**-8, 3 * 2.0**-8] + [0.0] * 14
    ties = torch.tensor([top + e2m1_tie_block() + sat + sub])
    return common("nvfp4", 16) + [
        case("nvfp4", "global 1: max scale, E2M1 ties, saturation, subnormal scale", ties),
        case(
            "nvfp4",
            "tiny block flushed to zero beside a large one",
            torch.tensor([[1e4] * 16 + [1e-4] * 16]),
        ),
    ]


def mx_tie_block(top: float, mids: list[float]) -> torch.Tensor:
    vals = [top, -top] + mids + [-m for m in mids]
    return torch.tensor(vals + [0.0] * (32 - len(vals)))


def mxfp4_cases() -> list[dict]:
    ties = mx_tie_block(7.5, [5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, 0.1])
    extremes = torch.stack([torch.full((32,), 2.0**-130), torch.full((32,), 2.0**127) * 1.5])
    return common("mxfp4", 32) + [
        case("mxfp4", "X = 0: E2M1 ties and saturation of 7.5", ties[None]),
        case("mxfp4", "scale exponent clamped at -127, and near the top", extremes),
    ]


def mxfp8_cases() -> list[dict]:
    ties = mx_tie_block(500.0, [432.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 15.5, 248.0])
    return common("mxfp8", 32) + [
        case("mxfp8", "X = 0: E4M3 ties, subnormals, saturation of 500", ties[None]),
    ]


def table_ties(table: tuple[float, ...], k: int) -> torch.Tensor:
    """Amax 1 (scale 1): each float32 midpoint of the table, plus the table itself."""
    t = torch.tensor(table)
    mids = (t[1:] + t[:-1]) * 0.5
    vals = torch.cat([t, mids])
    return torch.nn.functional.pad(vals, (0, k - vals.numel()))[None]


def nf_cases(fmt: str, table: tuple[float, ...]) -> list[dict]:
    return common(fmt, 64) + [
        case(fmt, "table midpoints (ties to even code)", table_ties(table, 64))
    ]


def int4_cases() -> list[dict]:
    g = torch.zeros(2, 128)  # the rest of each group is 0
    g[0, :6] = torch.tensor([15.0, 0.5, 1.5, 2.5, 7.5, 14.5])  # s = 1, z = 0
    g[1, :5] = torch.tensor([14.0, -1.0, 0.5, 1.5, -0.5])  # s = 1, z = 1: ties on odd z
    huge = torch.zeros(1, 128)
    huge[0, :2] = torch.tensor([1e6, -1e6])
    return common("int4", 128) + [
        case("int4", "scale 1 with zero point 0 and 1: ties to even code", g),
        case("int4", "float16 scale overflow is refused", huge),
        case(
            "int4", "group span below the float16 range flushes to zero", torch.full((1, 128), 1e-9)
        ),
    ]


def int4_group_cases(fmt: str, group: int) -> list[dict]:
    g = torch.zeros(1, group)
    g[0, :6] = torch.tensor([15.0, 0.5, 1.5, 2.5, 7.5, 14.5])  # s = 1, z = 0: ties to even
    return common(fmt, group) + [case(fmt, "scale 1, zero point 0: ties to even code", g)]


def lut_cases(fmt: str) -> list[dict]:
    bits = 4 if fmt == "lut4" else 3
    base = torch.tensor(NF4_TABLE if bits == 4 else NF3_TABLE)
    out = []
    for name, w in [
        ("gaussian, K not a multiple of the block", gaussian((2, 69), 11)),
        ("a zero block next to data", torch.cat([torch.zeros(1, 64), gaussian((1, 64), 12)], 1)),
        ("stacked experts [2, 1, 64]", gaussian((2, 1, 64), 13)),
        ("table midpoints (ties to even code)", table_ties(tuple(base.tolist()), 64)),
        ("all zeros", torch.zeros(1, 64)),
        ("float32 subnormals only", torch.full((1, 64), TINY) * torch.arange(64) / 64),
        ("+-float32 max", torch.tensor([[F32_MAX, -F32_MAX] * 32])),
    ]:
        rg = -(-w.shape[-2] // 256)
        levels = base if name.startswith("table") else base * 0.9
        table = levels.expand(*w.shape[:-2], rg, 1 << bits).contiguous()
        out.append(case(fmt, name, w, table=table))
    fitted = get_format(fmt).encode(gaussian((2, 64), 14))["table"]
    out.append(case(fmt, "a fitted table", gaussian((2, 64), 14), table=fitted))
    return out + refusals(fmt)


def vq_cases(fmt: str) -> list[dict]:
    """Common cases, plus codebook entries times 1/8 (vq2 and vq4 recover them exactly
    through the least-squares scale) and two blocks three decades apart along K."""
    f = get_format(fmt)
    picks = torch.arange(64 // f.dim) * 37 % (1 << f.index_bits)
    entries = f.codebook.float()[picks].reshape(1, 64) * 0.125
    steps = torch.tensor([[(-1.0) ** i * (1 + i % 3) for i in range(128)]]) * torch.tensor(
        [1.0] * 64 + [1e-3] * 64)
    return common(fmt, 64) + [
        case(fmt, "codebook entries times 1/8", entries),
        case(fmt, "two blocks three decades apart", steps),
    ]


BUILDERS = {
    "fp8": fp8_cases,
    "fp8-block": fp8_block_cases,
    "nvfp4": nvfp4_cases,
    "mxfp4": mxfp4_cases,
    "mxfp8": mxfp8_cases,
    "nf4": lambda: nf_cases("nf4", NF4_TABLE),
    "nf3": lambda: nf_cases("nf3", NF3_TABLE),
    "int4": int4_cases,
    "int4-g64": lambda: int4_group_cases("int4-g64", 64),
    "int4-g32": lambda: int4_group_cases("int4-g32", 32),
    "lut4": lambda: lut_cases("lut4"),
    "lut3": lambda: lut_cases("lut3"),
    "vq2": lambda: vq_cases("vq2"),
    "vq3": lambda: vq_cases("vq3"),
    "vq4": lambda: vq_cases("vq4"),
}


def main(names: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name in names or list(BUILDERS):
        if name not in FORMATS or name not in BUILDERS:
            raise SystemExit(f"no vectors for {name!r}; choose from {', '.join(BUILDERS)}")
        doc = {"format": name, "spec": "docs/FORMATS.md", "cases": BUILDERS[name]()}
        path = OUT / f"{name}.json"
        cases = ",\n".join(json.dumps(c) for c in doc["cases"])
        head = json.dumps({k: v for k, v in doc.items() if k != "cases"})[:-1]
        path.write_text(f'{head}, "cases": [\n{cases}\n]}}\n')
        print(f"{path}: {len(doc['cases'])} cases, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
