"""Tune the kernels' launch configs, or compile them for a GPU offline.

  python scripts/tune_kernels.py --static [--arch 90]
      No GPU needed: records the launches of the benchmark shapes (lowbit.kernels.launch
      .recording), compiles each for sm_<arch> and prints registers, spills and the
      instructions per weight of the main loop (from the SASS). Catches compile errors
      before any device time is spent.
  python scripts/tune_kernels.py --out configs.json [--shapes 14336x4096,...] [--formats ...]
      On a GPU: times candidate gemv configs (do_bench median, L2 flushed) for each shape,
      format and M, and writes the best per (shape, M bucket) in the format of
      lowbit/kernels/configs/<device>.json (merge it into that file to ship it).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from lowbit.kernels import launch  # noqa: E402
from lowbit.kernels.samples import (  # noqa: E402
    BENCH_LUT_FORMATS,
    BENCH_SHAPES,
    random_fp8_view,
    random_lut_view,
)
from lowbit.kernels.weights import resolve  # noqa: E402

SHAPES = BENCH_SHAPES  # N x K
FORMATS = BENCH_LUT_FORMATS
GEMV_CANDIDATES = [
    dict(BN=32, G=32, SPLIT_K=0, num_warps=4),
    dict(BN=16, G=32, SPLIT_K=0, num_warps=4),
    dict(BN=64, G=32, SPLIT_K=0, num_warps=4),
    dict(BN=32, G=64, SPLIT_K=0, num_warps=8),
]
TORCH_TO_TRITON = {
    torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64", torch.bfloat16: "*bf16",
    torch.float16: "*fp16", torch.float32: "*fp32", torch.float8_e4m3fn: "*fp8e4nv",
}


def make_weight(fmt: str, n: int, k: int, device: str, lead: tuple[int, ...] = ()):
    if fmt == "fp8":
        return resolve(random_fp8_view(n, k, layout="channel", lead=lead, device=device))
    if fmt == "fp8_block":
        return resolve(random_fp8_view(n, k, layout="block", lead=lead, device=device))
    return resolve(random_lut_view(n, k, lead=lead, device=device, **FORMATS[fmt]))


def _signature(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    names = kernel.arg_names
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(names):
        if name in kwargs:
            sig[name], consts[name] = "constexpr", kwargs[name]
            continue
        a = args[i]
        if isinstance(a, torch.Tensor):
            sig[name] = TORCH_TO_TRITON[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
            if a % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return sig, consts, attrs


def _loop_stats(sass: str) -> tuple[int, collections.Counter]:
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]{4})\*/", ln).group(1), 16) for ln in lines]
    best = None
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < addr[i] and int(m.group(1), 16) in addr:
            j = addr.index(int(m.group(1), 16))
            if best is None or i - j > best[1] - best[0]:
                best = (j, i)
    ops: collections.Counter = collections.Counter()
    if best is None:
        return 0, ops
    for ln in lines[best[0] : best[1] + 1]:
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", ln)
        if m:
            ops[m.group(1)] += 1
    return best[1] - best[0] + 1, ops


def compile_static(kernel, args, kwargs, arch: int) -> dict:
    from triton.backends.compiler import GPUTarget

    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    sig, consts, attrs = _signature(kernel, args, kwargs)
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    n, ops = _loop_stats(sass)
    return {"kernel": kernel.fn.__name__, "regs": int(regs.group(1)) if regs else -1,
            "local": re.search(r"LOCAL:(\d+)", res).group(1) if "LOCAL:" in res else "?",
            "loop": n, "ops": dict(ops.most_common(6)), "consts": consts, **options}


def static(arch: int, only: list[str]) -> None:
    from lowbit.kernels.dequant_gemm import lut_gemm, lut_gemv
    from lowbit.kernels.fp8_gemm import fp8_w8a8
    from lowbit.kernels.moe import fused_moe, fused_moe_gemv

    jobs = []
    for fmt in [*FORMATS, "fp8"]:
        n, k = SHAPES[1]
        w = make_weight(fmt, n, k, "cpu")
        for m in (1, 4, 16):
            jobs.append((f"gemv {fmt} M={m}", lambda w=w, m=m, k=k: lut_gemv(torch.randn(m, k).bfloat16(), w)))
        jobs.append((f"gemm {fmt} M=64", lambda w=w, k=k: lut_gemm(torch.randn(64, k).bfloat16(), w)))
    fb = make_weight("fp8_block", 4096, 4096, "cpu")
    jobs.append(("w8a8 block M=16", lambda: fp8_w8a8(torch.randn(16, 4096).bfloat16(), fb)))
    for fmt in ("nvfp4", "int4_g128", "dense"):
        e, h, i = 128, 2048, 768
        if fmt == "dense":
            w13 = resolve(torch.randn(e, 2 * i, h).bfloat16())
            w2 = resolve(torch.randn(e, h, i).bfloat16())
        else:
            w13, w2 = make_weight(fmt, 2 * i, h, "cpu", (e,)), make_weight(fmt, h, i, "cpu", (e,))
        for mode, t in (("decode", 4), ("grouped", 512)):
            ids = torch.randint(0, e, (t, 8), dtype=torch.int32)
            jobs.append((f"moe {mode} {fmt}", lambda w13=w13, w2=w2, mode=mode, ids=ids, t=t, h=h: fused_moe(
                torch.randn(t, h).bfloat16(), ids, torch.rand(t, 8), w13, w2, mode=mode)))
        if fmt != "dense":
            ids = torch.randint(0, e, (4, 8), dtype=torch.int32)
            jobs.append((f"moe gemv {fmt}", lambda w13=w13, w2=w2, ids=ids, h=h: fused_moe_gemv(
                torch.randn(4, h).bfloat16(), ids, torch.rand(4, 8), w13, w2)))
    for label, fn in jobs:
        if only and not any(o in label for o in only):
            continue
        with launch.recording() as rec:
            fn()
        for kernel, _grid, args, kwargs in rec:
            try:
                with contextlib.redirect_stderr(io.StringIO()):
                    st = compile_static(kernel, args, dict(kwargs), arch)
            except Exception as exc:  # report and keep going: the point is to see them all
                print(f"FAIL {label} {kernel.fn.__name__}: {type(exc).__name__}: {str(exc)[:400]}")
                continue
            print(f"ok   {label:24s} {st['kernel']:22s} regs {st['regs']:3d} local {st['local']} "
                  f"loop {st['loop']:4d} {st['ops']}")


def tune(out: str, shapes, formats, ms) -> None:
    from lowbit.bench.kernels import copies_for, payload_bytes, timed
    from lowbit.kernels.dequant_gemm import fmt_key, lut_gemv

    table: dict = {}
    for n, k in shapes:
        for fmt in formats:
            w = make_weight(fmt, n, k, "cuda")
            ws = [w] + [make_weight(fmt, n, k, "cuda") for _ in range(copies_for(payload_bytes(w)) - 1)]
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                best = None
                for cfg in GEMV_CANDIDATES:
                    try:
                        t = timed([lambda cfg=cfg, x=x, w=w: lut_gemv(x, w, config=cfg) for w in ws])["us"] / 1e3
                    except Exception as exc:  # a config the compiler rejects is skipped
                        print(f"skip {cfg}: {exc}")
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
                key = f"{fmt_key(w)}:{n}x{k}"
                table.setdefault(key, {})[str(triton.next_power_of_2(m))] = best[1]
                print(f"{fmt} {n}x{k} M={m}: {best[0] * 1e3:.1f} us with {best[1]}")
    name = torch.cuda.get_device_name()
    Path(out).write_text(json.dumps({"device": name, "gemv": table}, indent=1))
    print(f"wrote {out} for {name} ({launch.slug(name)}.json)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--static", action="store_true")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--out", default="configs.json")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--formats", default="int4,nvfp4")
    ap.add_argument("--m", default="1,4,16")
    ap.add_argument("--only", default="", help="--static: comma-separated label filters")
    a = ap.parse_args()
    if a.static:
        os.environ.setdefault("TRITON_INTERPRET", "0")
        static(a.arch, [o for o in a.only.split(",") if o])
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    tune(a.out, shapes, a.formats.split(","), [int(m) for m in a.m.split(",")])


if __name__ == "__main__":
    main()
