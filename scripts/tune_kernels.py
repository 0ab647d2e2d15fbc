"""Tune the kernels' launch configs, or compile them for a GPU offline.

  python scripts/tune_kernels.py --static [--arch 90]
      No GPU needed: records the launches of the benchmark shapes (lowbit.kernels.launch
      .recording), compiles each for sm_<arch> and prints registers, spills and the
      instructions per weight of the main loop (from the SASS). Catches compile errors
      before any device time is spent.
  python scripts/tune_kernels.py --out configs.json [--shapes 14336x4096,...] [--formats ...]
                                  [--m 1,2,4,8,16,32,64,512] [--jobs 12]
      On a GPU: times candidate gemv and gemm configs (CUDA-graph replay over weight copies
      past L2, as lowbit.bench.kernels) for each shape, format and M, against torch bf16 in
      the same run; writes the best per (shape, M bucket), the faster kernel per bucket
      ("choice", read by the linear routes) and the MoE per-slot gemv configs, in the format
      of lowbit/kernels/configs/<device>.json (copy it there to ship it), plus a .rows.json
      of every timing. --jobs N compiles every candidate first in N processes.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
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
    torch.uint8: "*u8", torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64", torch.bfloat16: "*bf16",
    torch.float16: "*fp16", torch.float32: "*fp32", torch.float64: "*fp64", torch.float8_e4m3fn: "*fp8e4nv",
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


def disassemble(cubin: bytes) -> tuple[str, str]:
    """(resource usage, SASS) of a cubin, from triton's bundled cuobjdump."""
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
    return res, sass


def compile_static(kernel, args, kwargs, arch: int) -> dict:
    from triton.backends.compiler import GPUTarget

    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
    sig, consts, attrs = _signature(kernel, args, kwargs)
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    res, sass = disassemble(compiled.asm["cubin"])
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
        ids = torch.randint(0, e, (4, 8), dtype=torch.int32)
        jobs.append((f"moe gemv {fmt}", lambda w13=w13, w2=w2, ids=ids, h=h: fused_moe_gemv(
            torch.randn(4, h).bfloat16(), ids, torch.rand(4, 8), w13, w2)))
    from lowbit.kernels import attention
    for kv in ("bf16", "fp8"):  # paged decode attention, Qwen3-30B-A3B heads (32 q, 4 KV, 128)
        dt = attention.FP8 if kv == "fp8" else torch.bfloat16
        scales = dict(k_scale=torch.ones(64, 4), v_scale=torch.ones(64, 4)) if kv == "fp8" else {}
        pool = attention.KVPool(torch.zeros(64, 4, 128, dtype=dt), torch.zeros(64, 4, 128, dtype=dt), 16, **scales)
        jobs.append((f"attention decode {kv} pool", lambda pool=pool: attention.paged_decode(
            torch.randn(1, 32, 128).bfloat16(), pool, torch.zeros(1, 4, dtype=torch.int32),
            torch.full((1,), 40, dtype=torch.int32), 0.1, num_splits=2)))
        jobs.append((f"attention prefill {kv} pool", lambda pool=pool: attention.paged_prefill(
            torch.randn(16, 32, 128).bfloat16(), pool, torch.zeros(1, 4, dtype=torch.int32),
            torch.full((1,), 40, dtype=torch.int32), torch.tensor([0, 16], dtype=torch.int32), 0.1)))
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


GEMM_SMALL = [dict(BN=bn, BK=bk, num_warps=w, num_stages=st, SPLIT_K=sk)
              for bn, bk, w, st, sk in ((32, 64, 4, 3, 0), (64, 64, 4, 3, 0), (64, 128, 4, 3, 0),
                                        (128, 64, 4, 3, 0), (128, 128, 8, 3, 0), (64, 64, 4, 4, 0),
                                        (64, 64, 4, 3, 1), (128, 64, 4, 3, 1))]
GEMM_LARGE = [dict(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=st, SPLIT_K=0)
              for bm, bn, bk, w, st in ((128, 128, 64, 8, 3), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3),
                                        (128, 128, 32, 8, 4), (128, 256, 64, 8, 3), (64, 64, 64, 4, 4))]
GEMV_TUNE = GEMV_CANDIDATES + [dict(BN=16, G=64, SPLIT_K=0, num_warps=4),
                               dict(BN=64, G=64, SPLIT_K=0, num_warps=8),
                               dict(BN=32, G=32, SPLIT_K=0, num_warps=4, PREFETCH=False),
                               dict(BN=32, G=32, SPLIT_K=1, num_warps=4),
                               dict(BN=32, G=32, SPLIT_K=8, num_warps=4)]
MOE_TUNE = [dict(BN=bn, G=g, SPLIT_K=sk, num_warps=w) for bn, g, sk, w in
            ((16, 32, 0, 4), (32, 32, 0, 4), (64, 32, 0, 4), (16, 64, 0, 4), (32, 64, 0, 8),
             (32, 32, 1, 4))]
# grouped MoE tiles (fused_moe mode "grouped"): BM slots a tile, FC1 / FC2 BN x BK, warps, stages
GROUPED_SMALL = [dict(BM=bm, BN1=n1, BK1=k1, BN2=n2, BK2=k2, num_warps=w, num_stages=st)
                 for bm, n1, k1, n2, k2, w, st in
                 ((16, 64, 128, 64, 128, 4, 3), (16, 128, 64, 128, 64, 4, 4), (16, 64, 256, 64, 256, 4, 3),
                  (32, 64, 128, 64, 128, 4, 3), (64, 64, 64, 64, 64, 4, 2))]
GROUPED_LARGE = [dict(BM=bm, BN1=n1, BK1=k1, BN2=n2, BK2=k2, num_warps=w, num_stages=st)
                 for bm, n1, k1, n2, k2, w, st in
                 ((64, 64, 64, 64, 64, 4, 2), (64, 128, 64, 128, 64, 4, 3), (32, 128, 64, 128, 64, 4, 3),
                  (64, 128, 128, 128, 128, 8, 3), (128, 128, 64, 128, 64, 8, 3))]
GROUPED_T = (32, 64, 512, 2048)  # 2048: a default prefill chunk
# Qwen3-30B-A3B's quantized linears at serving time: merged QKV and o_proj
ENGINE_SHAPES = ((5120, 2048), (2048, 4096))
MOE_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768)}  # E, top-k, H, I


def gemm_candidates(m: int) -> list[dict]:
    if m >= 256:
        return GEMM_LARGE
    bm = max(16, triton.next_power_of_2(m))
    return [dict(c, BM=bm) for c in GEMM_SMALL]


def _jobs(shapes, formats, ms):
    """(label, key, bucket, kernel, config, make_fn) for every timing of the linear sweep."""
    from lowbit.kernels.dequant_gemm import lut_gemm, lut_gemv

    for n, k in shapes:
        for fmt in formats:
            for m in ms:
                if m <= 16:
                    for cfg in GEMV_TUNE:
                        yield (n, k, fmt, m, "gemv", cfg, lut_gemv)
                for cfg in gemm_candidates(m):
                    yield (n, k, fmt, m, "gemm", cfg, lut_gemm)


def _rotating(fn, x, ws):
    """cfg -> one call of fn per weight copy (timed() rotates through them)."""
    def fns_for(cfg):
        return [functools.partial(fn, x, w, config=cfg) for w in ws]
    return fns_for


def _moe_calls(batches, w13, w2):
    """MoE per-slot gemv calls over the routings, for a {fc1, fc2} config."""
    from lowbit.kernels.moe import fused_moe_gemv

    def fns_for(cfg):
        return [functools.partial(fused_moe_gemv, *b, w13, w2, config=cfg) for b in batches]
    return fns_for


def _time_best(fns_for, cands) -> tuple[float, dict] | None:
    from lowbit.bench.kernels import timed

    best = None
    for cfg in cands:
        try:
            t = timed(fns_for(cfg))["us"]
        except Exception as exc:  # a config the compiler or the shared memory rejects
            print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    return best


def tune(out: str, shapes, formats, ms, part: tuple[int, int] | None = None) -> None:
    """Time every candidate; write the fastest per (format, shape, M bucket) for the gemv and
    the gemm, the faster of the two as "choice" (read by the linear routes), and the MoE
    per-slot gemv's FC1 / FC2 configs. part=(i, n): only compile every n-th job (a warm-up
    worker filling Triton's disk cache in parallel; no timing, nothing written)."""
    from lowbit.bench.kernels import copies_for, payload_bytes, timed
    from lowbit.kernels.dequant_gemm import fmt_key

    if part is not None:
        weights = {}
        for i, (n, k, fmt, m, kind, cfg, fn) in enumerate(_jobs(shapes, formats, ms)):
            if i % part[1] != part[0]:
                continue
            w = weights.setdefault((n, k, fmt), make_weight(fmt, n, k, "cuda"))
            try:
                fn(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), w, config=dict(cfg))
            except Exception as exc:
                print(f"  compile skip {kind} {cfg}: {type(exc).__name__}", flush=True)
        torch.cuda.synchronize()
        return
    from lowbit.kernels.dequant_gemm import lut_gemm, lut_gemv

    table: dict = {"gemv": {}, "gemm": {}, "choice": {}}
    rows = []
    for n, k in shapes:
        bf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]
        for fmt in formats:
            w = make_weight(fmt, n, k, "cuda")
            ws = [w] + [make_weight(fmt, n, k, "cuda") for _ in range(copies_for(payload_bytes(w)) - 1)]
            key = f"{fmt_key(w)}:{n}x{k}"
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                bucket = str(triton.next_power_of_2(m))
                base = timed([lambda x=x, b=b: torch.nn.functional.linear(x, b) for b in bf])["us"]
                gv = _time_best(_rotating(lut_gemv, x, ws), GEMV_TUNE) if m <= 16 else None
                gm = _time_best(_rotating(lut_gemm, x, ws), gemm_candidates(m))
                if gv:
                    table["gemv"].setdefault(key, {})[bucket] = gv[1]
                if gm:
                    table["gemm"].setdefault(key, {})[bucket] = gm[1]
                pick = "gemv" if gv and (not gm or gv[0] <= gm[0]) else "gemm"
                table["choice"].setdefault(key, {})[bucket] = pick
                best = min(t for t in (gv and gv[0], gm and gm[0]) if t)
                rows.append(dict(fmt=fmt, shape=f"{n}x{k}", m=m, bf16_us=base, gemv_us=gv and gv[0],
                                 gemm_us=gm and gm[0], pick=pick, vs_bf16=base / best,
                                 tbps=payload_bytes(w) / best / 1e6, gemv_cfg=gv and gv[1],
                                 gemm_cfg=gm and gm[1]))
                r = rows[-1]
                print(f"{fmt:10s} {n}x{k} M={m:3d}: bf16 {base:7.1f}  gemv "
                      f"{'-' if gv is None else f'{gv[0]:7.1f}'}  gemm "
                      f"{'-' if gm is None else f'{gm[0]:7.1f}'} us -> {pick} "
                      f"({r['vs_bf16']:.2f}x bf16, {r['tbps']:.2f} TB/s)", flush=True)
            del ws
        del bf
        torch.cuda.empty_cache()
    table["moe_gemv"], moe_rows = tune_moe()
    name = torch.cuda.get_device_name()
    Path(out).write_text(json.dumps({"device": name, **table}, indent=1))
    Path(out).with_suffix(".rows.json").write_text(json.dumps(rows + moe_rows, indent=1))
    print(f"wrote {out} for {name} ({launch.slug(name)}.json)")


def tune_moe() -> tuple[dict, list]:
    """FC1, then FC2 configs of the per-slot MoE gemv at T = 1, 2, 4, 8 tokens, for nvfp4
    and bf16 experts, over 8 routings (graph replay), against the tensor-core tile route."""
    from lowbit.bench.kernels import timed
    from lowbit.kernels.moe import fused_moe

    table: dict = {}
    rows = []
    for model, (e, top, h, inter) in MOE_SHAPES.items():
        for fmt in ("nvfp4", "dense"):
            if fmt == "dense":
                w13 = resolve(torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16) * 0.02)
                w2 = resolve(torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16) * 0.02)
                key = f"dense:{e}x{h}"
            else:
                w13, w2 = make_weight(fmt, 2 * inter, h, "cuda", (e,)), make_weight(fmt, h, inter, "cuda", (e,))
                key = f"lut4:{e}x{h}"
            for t in (1, 2, 4, 8):
                g = torch.Generator(device="cuda").manual_seed(t)
                batches = [(torch.randn(t, h, device="cuda", dtype=torch.bfloat16),
                            torch.rand(t, e, device="cuda", generator=g).topk(top, -1).indices.to(torch.int32),
                            torch.rand(t, top, device="cuda", generator=g)) for _ in range(8)]

                fns = _moe_calls(batches, w13, w2)
                d2 = dict(GEMV_CANDIDATES[0])
                fc1 = _time_best(lambda c, fns=fns, d2=d2: fns(dict(fc1=c, fc2=d2)), MOE_TUNE)
                fc2 = _time_best(lambda c, fns=fns, f1=fc1[1]: fns(dict(fc1=f1, fc2=c)), MOE_TUNE)
                tc = timed([functools.partial(fused_moe, *b, w13, w2, mode="decode") for b in batches])["us"]
                table.setdefault(key, {})[str(t)] = dict(fc1=fc1[1], fc2=fc2[1])
                rows.append(dict(fmt=fmt, shape=model, m=t, gemv_us=fc2[0], tc_us=tc,
                                 fc1=fc1[1], fc2=fc2[1]))
                print(f"moe {model} {fmt} T={t}: gemv {fc2[0]:.1f} us (fc1 {fc1[1]}, fc2 {fc2[1]}), "
                      f"tiles {tc:.1f} us", flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    return table, rows


def _moe_weights(fmt: str, e: int, h: int, inter: int):
    if fmt == "dense":
        return (resolve(torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16) * 0.02),
                resolve(torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16) * 0.02), f"dense:{e}x{h}")
    from lowbit.kernels.moe import moe_fmt_keys

    w13 = make_weight(fmt, 2 * inter, h, "cuda", (e,))
    return w13, make_weight(fmt, h, inter, "cuda", (e,)), f"{moe_fmt_keys(w13)[0]}:{e}x{h}"


def tune_grouped(out: str, part: tuple[int, int] | None = None,
                 formats: tuple[str, ...] = ("dense", "nvfp4")) -> None:
    """Tile configs of the grouped MoE (fused_moe mode "grouped": slots sorted by expert,
    tensor-core tiles) at T = 32, 64, 512 and 2048 tokens (batched decode and prefill
    chunks), bf16 and nvfp4 experts (formats) at the Qwen3-30B-A3B shape, 8 routings (graph
    replay); writes the fastest per (format key, T) as the "moe_grouped" table (nvfp4 under
    its own key, moe.moe_fmt_keys). part: compile every n-th job only."""
    from lowbit.bench.kernels import timed
    from lowbit.kernels.moe import fused_moe

    table: dict = {}
    rows = []
    job = 0
    for model, (e, top, h, inter) in MOE_SHAPES.items():
        for fmt in formats:
            w13, w2, key = _moe_weights(fmt, e, h, inter)
            for t in GROUPED_T:
                g = torch.Generator(device="cuda").manual_seed(t)
                batches = [(torch.randn(t, h, device="cuda", dtype=torch.bfloat16),
                            torch.rand(t, e, device="cuda", generator=g).topk(top, -1).indices.to(torch.int32),
                            torch.rand(t, top, device="cuda", generator=g)) for _ in range(8)]
                cands = GROUPED_SMALL if t <= 64 else GROUPED_LARGE
                if part is not None:
                    for cfg in cands:
                        job += 1
                        if job % part[1] == part[0]:
                            try:
                                fused_moe(*batches[0], w13, w2, mode="grouped", config=dict(cfg))
                            except Exception as exc:
                                print(f"  compile skip {cfg}: {type(exc).__name__}", flush=True)
                    continue
                times = []
                for cfg in cands:
                    try:
                        us = timed([functools.partial(fused_moe, *b, w13, w2, mode="grouped", config=dict(cfg))
                                    for b in batches])["us"]
                    except Exception as exc:
                        print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                        continue
                    times.append((us, cfg))
                    print(f"  moe grouped {fmt} T={t} {cfg}: {us:.1f} us", flush=True)
                best = min(times, key=lambda r: r[0])
                table.setdefault(key, {})[str(t)] = best[1]
                default = next((us for us, c in times if c == GROUPED_LARGE[0]), None)
                rows.append(dict(fmt=fmt, shape=model, m=t, best_us=best[0], default_us=default, cfg=best[1]))
                print(f"moe grouped {model} {fmt} T={t}: best {best[0]:.1f} us {best[1]} "
                      f"(default tiles {default if default is None else round(default, 1)} us)", flush=True)
            del w13, w2
            torch.cuda.empty_cache()
    if part is None:
        name = torch.cuda.get_device_name()
        Path(out).write_text(json.dumps({"device": name, "moe_grouped": table}, indent=1))
        Path(out).with_suffix(".rows.json").write_text(json.dumps(rows, indent=1))
        print(f"wrote {out}")


def warm_compile(args: list[str], jobs: int) -> None:
    """Fill Triton's disk cache with `jobs` worker processes (compiles run in parallel)."""
    procs = [subprocess.Popen([sys.executable, __file__, *args, "--part", f"{i}/{jobs}"])
             for i in range(jobs)]
    for p in procs:
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--static", action="store_true")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--out", default="configs.json")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--formats", default="int4_g128,nvfp4")
    ap.add_argument("--m", default="1,2,4,8,16,32,64,512")
    ap.add_argument("--jobs", type=int, default=0, help="parallel compile workers before timing")
    ap.add_argument("--part", default="", help=argparse.SUPPRESS)
    ap.add_argument("--only", default="", help="--static: comma-separated label filters")
    ap.add_argument("--grouped", action="store_true", help="sweep the grouped MoE tiles only")
    ap.add_argument("--grouped-formats", default="dense,nvfp4", help="--grouped: expert formats")
    a = ap.parse_args()
    if a.grouped:
        gf = tuple(a.grouped_formats.split(","))
        if a.part:
            tune_grouped(a.out, tuple(int(v) for v in a.part.split("/")), gf)
            torch.cuda.synchronize()
            return
        if a.jobs > 1:
            warm_compile(sys.argv[1:], a.jobs)
        tune_grouped(a.out, formats=gf)
        return
    if a.static:
        os.environ.setdefault("TRITON_INTERPRET", "0")
        static(a.arch, [o for o in a.only.split(",") if o])
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    ms = [int(m) for m in a.m.split(",")]
    if a.part:
        i, n = (int(v) for v in a.part.split("/"))
        tune(a.out, shapes, a.formats.split(","), ms, part=(i, n))
        return
    if a.jobs > 1:
        warm_compile(sys.argv[1:], a.jobs)
    tune(a.out, shapes, a.formats.split(","), ms)


if __name__ == "__main__":
    main()
