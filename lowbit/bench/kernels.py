"""Kernel roofline benchmark: ceilings, in-process peers, then our routes, on one GPU.

  python -m lowbit.bench.kernels --out DIR [--quick]

1. Ceilings: device-to-device copy bandwidth (bytes read + written) and a bf16 matmul.
2. Linear, N x K in {4096x14336, 14336x4096, 2048x6144}, M in {1, 4, 16}: peers torch bf16
   (cuBLAS), torch._weight_int4pack_mm (tinygemm, int4 g128), torch._scaled_mm (fp8, M
   padded to 16); ours per weight format (gemv; gemm at M = 16; fp8 W8A8, in Triton and
   through torch._scaled_mm) and the tensor-core nvfp4 gemv ("mma gemv", lowbit.kernels.tc_gemv).
3. MoE layer at C1/C4/C16/C32/C64 for Qwen3-30B-A3B (E=128, top-8, 2048 -> 768) and Mixtral
   (E=8, top-2, 4096 -> 14336): peer torch bf16 (loop over the experts used), ours in
   nvfp4 and int4 (per-slot gemv, decode tiles up to 256 slots, grouped tiles and the gemv
   with its slots launched in expert order from C16; nvfp4 also the tensor-core per-slot
   "mma gemv" and, from C4, the expert-grouped "mma grouped" of lowbit.kernels.tc_moe) and
   bf16 (tensor-core tiles);
   DeepSeek-V3 (E=256, top-8, 7168 -> 2048) in nvfp4 and gpt-oss-20b (E=32, top-4,
   2880 -> 2880) in mxfp4 with its expert biases and clamped SwiGLU (MOE_EXTRAS), on every
   implementation, the torch peer included.
4. Mixed layouts (moe_mixed): Qwen3-30B-A3B with 16 hot experts nvfp4 and 112 cold nf3 in
   one launch pair; DeepSeek-V3 with its shared expert fused as a slot of weight 1, against
   the routed launch plus the shared MLP as three gemvs.
5. Router (router): the gate GEMM + top-k at T = 1, 4, 16, 64 for Qwen3-30B-A3B and
   DeepSeek-V3: cuBLAS (the activation's float32 copy, the GEMM) + triton_topk, the Triton
   gate GEMV + triton_topk (two launches, the default), and triton_gate_topk (one launch).
6. Prefill linears (prefill_linear): in-register-decode gemm against decode-once + cuBLAS.
7. Grouped MoE (moe_grouped): Qwen3-30B-A3B at T = 32, 64, 512, 2048 (batched decode and
   prefill chunks) in bf16, nvfp4 (exact bf16x2 tiles, and the float32 decode chain they
   replace) and int4 g128.
Times: CUDA-graph replays of back-to-back calls that rotate through weight copies (linear)
or routings (MoE) holding more bytes than L2, three repeats: median, min and max (GPU
time, no host launch overhead; the torch expert loop reads ids on the host, so it is timed
eagerly with do_bench instead). Bandwidth counts the weight payload each call must read once
(for MoE, only the experts the routing used); % copy is that over the measured copy rate.
Each of our cases is checked once against its torch twin (relative error reported).
Writes DIR/kernels.json and DIR/kernels.md after every section.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lowbit.formats.views import DenseWeight, Fp8View
from lowbit.kernels import launch, router_op
from lowbit.kernels.dequant import lut_dequant_mm
from lowbit.kernels.dequant_gemm import lut_gemm, lut_gemv, reference_linear
from lowbit.kernels.fp8_gemm import fp8_w8a8, reference_w8a8, scaled_mm_w8a8
from lowbit.kernels.moe import fused_moe, fused_moe_gemv, moe_fmt_keys, reference_moe, torch_act
from lowbit.kernels.moe_hybrid import fused_moe_hybrid, reference_hybrid
from lowbit.kernels.moe_layout import hybrid_experts, make_group, shared_group, with_shared_slots
from lowbit.kernels.moe_op import MoeActivation
from lowbit.kernels.router_op import RouterSpec, gate_logits, reference_route
from lowbit.kernels.runtime import triton
from lowbit.kernels.samples import BENCH_LUT_FORMATS, BENCH_SHAPES, random_fp8_view, random_lut_view
from lowbit.kernels.tc_gemv import tc_gemv
from lowbit.kernels.tc_moe import tc_moe_gemv, tc_moe_grouped, tc_moe_refusal
from lowbit.kernels.weights import resolve

SHAPES = BENCH_SHAPES
MS = (1, 4, 8, 16)
LUT_FORMATS = BENCH_LUT_FORMATS
MOE_MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336),
              "deepseek-v3": (256, 8, 7168, 2048), "gpt-oss-20b": (32, 4, 2880, 2880)}
# formats per model: gpt-oss ships mxfp4 experts
MOE_FORMATS = {"deepseek-v3": ("nvfp4",), "gpt-oss-20b": ("mxfp4",)}
# gpt-oss experts: biases b13 [E, 2I] / b2 [E, H] (bf16, as checkpoints store them) and the
# clamped SwiGLU with this limit (its swiglu_limit); "tiny-oss" runs the same path in --smoke
MOE_EXTRAS = {"gpt-oss-20b": 7.0, "tiny-oss": 7.0}
SHARED = {"deepseek-v3": 1}  # shared experts of width I, fused as extra slots (section moe_mixed)
HYBRID_HOT = 16  # hybrid cell: the 16 hottest of Qwen3-30B-A3B's 128 experts nvfp4, the rest nf3
MOE_CONCURRENCY = (1, 4, 16, 32, 64)  # 32 / 64: batched decode, where the grouped route runs
DEV = "cuda"
SMOKE = False  # --smoke: tiny shapes on the CPU through the Triton interpreter (code paths only)


def timed(fns, repeats: int = 3) -> dict:
    """Median / min / max microseconds per call of fns (one callable, or one per weight copy
    so that the calls rotate through more bytes than L2 holds), replayed as a CUDA graph:
    GPU time without the host's launch overhead, as the engine's decode step runs."""
    fns = fns if isinstance(fns, list) else [fns]
    if SMOKE:
        t0 = time.perf_counter()
        fns[0]()
        us = (time.perf_counter() - t0) * 1e6
        return {"us": us, "min_us": us, "max_us": us}
    for f in fns:
        f()  # compile, resolve, warm up outside the capture
    torch.cuda.synchronize()
    calls = len(fns) * max(1, 24 // len(fns))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(4):
            graph.replay()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / (4 * calls))
    runs.sort()
    return {"us": runs[len(runs) // 2], "min_us": runs[0], "max_us": runs[-1]}


def timed_eager(fn, repeats: int = 3) -> dict:
    """For calls a graph cannot hold (host reads): do_bench median, L2 flushed per call."""
    if SMOKE:
        return timed(fn)
    runs = sorted(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") for _ in range(repeats))
    return {"us": runs[1] * 1e3, "min_us": runs[0] * 1e3, "max_us": runs[-1] * 1e3}


def copies_for(nbytes: int) -> int:
    """Weight copies whose total exceeds 4x a 60 MB L2 (at most 16)."""
    return 1 if SMOKE else max(2, min(16, -(-240 * 2**20 // max(nbytes, 1))))


def payload_bytes(w) -> int:
    if isinstance(w, DenseWeight):
        ts = [w.w]
    elif isinstance(w, Fp8View):
        ts = [w.codes, w.scales]
    else:
        v = w.view
        ts = [v.codes, v.scales, v.table, v.offsets, v.table_index]
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def ceilings() -> dict:
    a = torch.empty(1 << (16 if SMOKE else 30), dtype=torch.uint8, device=DEV)
    a.random_()
    b = torch.empty_like(a)
    # eager: inside a CUDA graph copy_ becomes a memcpy node run by the copy engines, slower
    # than the SMs' copy kernel (measured 2.77 vs 4.22 TB/s on an H200)
    copy = timed_eager(lambda a=a, b=b: b.copy_(a))
    n = 64 if SMOKE else 8192
    x = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    mm = timed(lambda x=x, y=y: x @ y)
    return {"copy_TBps": 2 * a.numel() / copy["us"] / 1e6, "copy": copy,
            "bf16_TFLOPs": 2 * n**3 / mm["us"] / 1e6, "matmul": mm}


def _peers(n: int, k: int) -> dict:
    """name -> (make(copy) -> fn(x), weight bytes); peers this torch build lacks are left out."""
    out = {}

    def bf16(_i):
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
        return lambda x: F.linear(x, w)

    out["torch bf16"] = (bf16, n * k * 2)

    def tinygemm(_i):
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=DEV)
        wp = torch._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), 8)
        sz = torch.randn(k // 128, n, 2, dtype=torch.bfloat16, device=DEV)
        return lambda x: torch._weight_int4pack_mm(x, wp, 128, sz)

    def scaled(_i):
        wq = torch.randn(n, k, device=DEV).to(torch.float8_e4m3fn)
        one = torch.tensor(1.0, device=DEV)
        xq = torch.zeros(16, k, device=DEV, dtype=torch.float8_e4m3fn)  # M padded to 16
        return lambda x: torch._scaled_mm(xq[: max(16, x.shape[0])], wq.t(), scale_a=one,
                                          scale_b=one, out_dtype=torch.bfloat16)

    for name, make, nbytes in (("torch int4 tinygemm", tinygemm, n * k // 2 + k // 128 * n * 4),
                               ("torch _scaled_mm fp8", scaled, n * k)):
        try:
            make(0)(torch.randn(1, k, device=DEV, dtype=torch.bfloat16))
            out[name] = (make, nbytes)
        except Exception as exc:  # noqa: BLE001 - a peer this build lacks is reported, not fatal
            print(f"  {name} unavailable: {type(exc).__name__}: {exc}"[:200], flush=True)
    return out


def _ours(n: int, k: int) -> dict:
    """name -> (make(copy) -> weight, route, fn(x, w))."""
    out = {}
    for name, kw in LUT_FORMATS.items():
        make = lambda i, kw=kw: resolve(random_lut_view(n, k, device=DEV, seed=i, **kw))  # noqa: E731
        out[f"{name} gemv"] = (make, "gemv", lut_gemv)
        if name in ("int4_g128", "nvfp4"):
            out[f"{name} gemm"] = (make, "gemm", lut_gemm)
        if name == "nvfp4" and not SMOKE:  # a Gluon kernel: no interpreter
            out[f"{name} mma gemv"] = (make, "mma", tc_gemv)
    out["fp8 w8a16 gemv"] = (lambda i: resolve(random_fp8_view(n, k, layout="channel", device=DEV, seed=i)),
                             "gemv", lut_gemv)
    out["fp8 w8a8 (128x128)"] = (lambda i: resolve(random_fp8_view(n, k, layout="block", device=DEV, seed=i)),
                                 "w8a8", fp8_w8a8)
    if not SMOKE:  # route torch_scaled_mm: per-token quantization + torch._scaled_mm (both modes)
        chan = lambda i: resolve(random_fp8_view(n, k, layout="channel", device=DEV, seed=i))  # noqa: E731
        out["fp8 w8a8 _scaled_mm"] = (chan, "w8a8", scaled_mm_w8a8)
        out["fp8 w8a8 _scaled_mm rowwise"] = (chan, "w8a8", functools.partial(scaled_mm_w8a8, mode="rowwise"))
    return out


def linear_section(copy_tbps: float, quick: bool) -> list[dict]:
    rows = []
    for n, k in ((96, 256),) if SMOKE else (SHAPES[:1] if quick else SHAPES):
        peers = {name: ([make(i) for i in range(copies_for(nb))], nb)
                 for name, (make, nb) in _peers(n, k).items()}
        ours = {}
        for name, (make, route, fn) in _ours(n, k).items():
            w0 = make(0)
            ours[name] = ([w0] + [make(i) for i in range(1, copies_for(payload_bytes(w0)))], route, fn)
        for m in MS:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            base = None
            for name, (fns, nbytes) in peers.items():
                t = timed([lambda fn=fn, x=x: fn(x) for fn in fns])
                base = base or t["us"]
                rows.append(_row("linear", f"{n}x{k}", m, name, t, nbytes, copy_tbps, None, base))
                print(_fmt(rows[-1]), flush=True)
            for name, (ws, route, fn) in ours.items():
                if route == "gemm" and m < 4:
                    continue
                try:
                    w = ws[0]
                    y = fn(x, w)
                    ref = reference_w8a8(x, w) if route == "w8a8" else reference_linear(x, w)
                    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = timed([lambda fn=fn, w=w, x=x: fn(x, w) for w in ws])
                except Exception as exc:  # noqa: BLE001 - keep the other rows
                    print(f"  FAIL {name} M={m}: {type(exc).__name__}: {exc}"[:300], flush=True)
                    continue
                rows.append(_row("linear", f"{n}x{k}", m, name, t, payload_bytes(w), copy_tbps,
                                 err, base))
                print(_fmt(rows[-1]), flush=True)
        del peers, ours
        torch.cuda.empty_cache()
    return rows


PREFILL_SHAPES = ((5120, 2048), (2048, 4096), (4096, 14336))  # Qwen3-30B-A3B qkv, o_proj; a dense FFN
PREFILL_MS = (64, 128, 256, 512, 2048, 8192)


def prefill_linear_section(copy_tbps: float, quick: bool) -> list[dict]:
    """Prefill-sized linears: the in-register-decode gemm against decode-once + cuBLAS
    (route triton_lut_dequant), with cuBLAS on a bf16 weight of the shape as the ceiling."""
    rows = []
    shapes = ((96, 256),) if SMOKE else (PREFILL_SHAPES[:1] if quick else PREFILL_SHAPES)
    for n, k in shapes:
        dense = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
        ours = {}
        for fmt in ("nvfp4", "int4_g128"):
            w = resolve(random_lut_view(n, k, device=DEV, seed=1, **LUT_FORMATS[fmt]))
            ours[f"{fmt} gemm"] = (w, lut_gemm)
            ours[f"{fmt} dequant+cuBLAS"] = (w, lut_dequant_mm)
        ours["fp8 dequant+cuBLAS"] = (resolve(random_fp8_view(n, k, layout="block", device=DEV, seed=1)),
                                      lut_dequant_mm)
        for m in ((64,) if SMOKE else PREFILL_MS):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            t = timed([lambda x=x, d=dense: F.linear(x, d)])
            base = t["us"]
            rows.append(_row("prefill", f"{n}x{k}", m, "torch bf16", t, n * k * 2, copy_tbps, None, base))
            print(_fmt(rows[-1]), flush=True)
            for name, (w, fn) in ours.items():
                try:
                    y = fn(x, w)
                    ref = reference_linear(x, w, dot_dtype=torch.bfloat16)
                    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = timed([lambda fn=fn, w=w, x=x: fn(x, w)])
                except Exception as exc:  # noqa: BLE001 - keep the other rows
                    print(f"  FAIL {name} M={m}: {type(exc).__name__}: {exc}"[:300], flush=True)
                    continue
                rows.append(_row("prefill", f"{n}x{k}", m, name, t, payload_bytes(w), copy_tbps, err, base))
                print(_fmt(rows[-1]), flush=True)
        del dense, ours
        torch.cuda.empty_cache() if DEV == "cuda" else None
    return rows


def _torch_moe(x, ids, wts, w13, w2, b13=None, b2=None, activation=None):
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        h = F.linear(x[tok], w13[e], None if b13 is None else b13[e])
        y = F.linear(torch_act(h, activation), w2[e], None if b2 is None else b2[e])
        out.index_add_(0, tok, y.float() * wts[tok, slot, None])
    return out.to(x.dtype)


def _moe_extras(model: str, e: int, h: int, inter: int) -> dict:
    """gpt-oss's expert biases and clamped SwiGLU (MOE_EXTRAS), or {} for the other models."""
    limit = MOE_EXTRAS.get(model)
    if limit is None:
        return {}
    return dict(b13=torch.randn(e, 2 * inter, device=DEV, dtype=torch.bfloat16) * 0.1,
                b2=torch.randn(e, h, device=DEV, dtype=torch.bfloat16) * 0.1,
                activation=MoeActivation("swiglu_oai", limit=limit))


def moe_section(copy_tbps: float, quick: bool) -> list[dict]:
    rows = []
    models = {"tiny": (8, 2, 64, 32), "tiny-oss": (8, 2, 64, 32)} if SMOKE else MOE_MODELS
    for model, (e, top, h, inter) in models.items():
        if quick and model != "qwen3-30b-a3b":
            continue
        dense13 = torch.randn(e, 2 * inter, h, device=DEV, dtype=torch.bfloat16) * 0.02
        dense2 = torch.randn(e, h, inter, device=DEV, dtype=torch.bfloat16) * 0.02
        weights = {"bf16": (resolve(dense13), resolve(dense2))}
        extras = _moe_extras(model, e, h, inter)
        bias_bytes = sum(b[0].nbytes for k, b in extras.items() if k != "activation")  # per expert
        for fmt in MOE_FORMATS.get(model, ("nvfp4", "int4_g128")):
            kw = LUT_FORMATS[fmt]
            weights[fmt] = (resolve(random_lut_view(2 * inter, h, lead=(e,), device=DEV, **kw)),
                            resolve(random_lut_view(h, inter, lead=(e,), device=DEV, seed=1, **kw)))
        for c in MOE_CONCURRENCY:
            g = torch.Generator(device=DEV).manual_seed(c)
            batches = []  # 8 routings: consecutive calls read different experts, not L2
            for _ in range(1 if SMOKE else 8):
                ids = torch.rand(c, e, device=DEV, generator=g).topk(top, -1).indices.to(torch.int32)
                batches.append((torch.randn(c, h, device=DEV, dtype=torch.bfloat16), ids,
                                torch.rand(c, top, device=DEV, generator=g)))
            x, ids, wts = batches[0]
            active = sum(b[1].unique().numel() for b in batches) / len(batches)
            t = timed_eager(lambda x=x, ids=ids, wts=wts, d13=dense13, d2=dense2, kw=extras:
                            _torch_moe(x, ids, wts, d13, d2, **kw))
            base = t["us"]
            rows.append(_row("moe", model, c, "torch bf16 expert loop", t,
                             int(active * (3 * inter * h * 2 + bias_bytes)), copy_tbps, None, base))
            print(_fmt(rows[-1]), flush=True)
            for fmt, (w13, w2) in weights.items():
                impls = [("gemv", fused_moe_gemv), ("tc", fused_moe)]
                if c * top > 256:  # the decode tiles map at most 256 slots
                    impls = impls[:1]
                if c >= 16:
                    impls += [("grouped", fused_moe), ("gemv sorted", fused_moe_gemv)]
                if not SMOKE and tc_moe_refusal(batches[0][0], w13, w2, **extras) is None:
                    impls.append(("mma gemv", tc_moe_gemv))  # tensor-core per-slot gemv
                    if c >= 4:  # each expert read once for its tokens
                        impls.append(("mma grouped", tc_moe_grouped))
                for impl, fn in impls:
                    if impl in ("gemv", "mma gemv", "mma grouped"):
                        call = (lambda b, fn=fn, w13=w13, w2=w2, kw=extras: fn(*b, w13, w2, **kw))
                    elif impl == "gemv sorted":  # config SORT_SLOTS: slots launched in expert order
                        cfg = dict(dict(BN=16, G=8) if SMOKE else
                                   launch.lookup("moe_gemv", moe_fmt_keys(w13), e, h, c), SORT_SLOTS=True)
                        call = (lambda b, w13=w13, w2=w2, kw=extras, cfg=cfg:
                                fused_moe_gemv(*b, w13, w2, config=cfg, **kw))
                    else:
                        call = (lambda b, w13=w13, w2=w2, kw=extras, mode="decode" if impl == "tc" else "grouped":
                                fused_moe(*b, w13, w2, mode=mode, **kw))
                    try:
                        err = None
                        if c in (4, 32):
                            y = call(batches[0])
                            ref = reference_moe(x, ids, wts, w13, w2, **extras)
                            err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                        t = timed([lambda b=b, call=call: call(b) for b in batches])
                    except Exception as exc:  # noqa: BLE001
                        print(f"  FAIL moe {model} {fmt} {impl} C{c}: {type(exc).__name__}: {exc}"[:300], flush=True)
                        continue
                    nbytes = int(active * ((payload_bytes(w13) + payload_bytes(w2)) / e + bias_bytes))
                    rows.append(_row("moe", model, c, f"ours {fmt} {impl}", t, nbytes, copy_tbps, err, base))
                    print(_fmt(rows[-1]), flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


def _moe_batches(c: int, e: int, top: int, h: int, hot: int = 0) -> list:
    """8 routings of c tokens (1 in smoke runs); hot > 0 skews them: the first slot of each
    token picks one of experts 0 .. hot-1 (the hybrid layout's hot group)."""
    g = torch.Generator(device=DEV).manual_seed(c)
    out = []
    for _ in range(1 if SMOKE else 8):
        ids = torch.rand(c, e, device=DEV, generator=g)
        if hot:
            ids[:, :hot] += 1.0
        ids = ids.topk(top, -1).indices.to(torch.int32)
        out.append((torch.randn(c, h, device=DEV, dtype=torch.bfloat16), ids,
                    torch.rand(c, top, device=DEV, generator=g)))
    return out


GROUPED_T = (32, 64, 512, 2048)


def moe_grouped_section(copy_tbps: float, quick: bool) -> list[dict]:
    """The grouped MoE (route triton_moe_grouped: batched decode above 16 tokens, prefill) at
    the Qwen3-30B-A3B shape: bf16 experts, nvfp4 with exact bf16x2 tiles (the default) and
    with the float32 decode chain (E2M1_BF16 off), int4 g128; launch configs as the engine
    looks them up. Bytes: the experts a routing uses; the ratio is against bf16."""
    e, top, h, inter = (8, 2, 64, 32) if SMOKE else MOE_MODELS["qwen3-30b-a3b"]
    rows = []
    stacks = {"bf16": (resolve(torch.randn(e, 2 * inter, h, device=DEV, dtype=torch.bfloat16) * 0.02),
                       resolve(torch.randn(e, h, inter, device=DEV, dtype=torch.bfloat16) * 0.02))}
    for fmt in ("nvfp4", "int4_g128"):
        kw = LUT_FORMATS[fmt]
        stacks[fmt] = (resolve(random_lut_view(2 * inter, h, lead=(e,), device=DEV, **kw)),
                       resolve(random_lut_view(h, inter, lead=(e,), device=DEV, seed=1, **kw)))
    impls = [("bf16", "bf16", {}), ("nvfp4", "nvfp4 bf16x2 tiles", {}),
             ("nvfp4", "nvfp4 f32 decode", {"E2M1_BF16": False}), ("int4_g128", "int4_g128", {})]
    for c in ((4,) if SMOKE else (GROUPED_T[:2] if quick else GROUPED_T)):
        batches = _moe_batches(c, e, top, h)
        active = sum(b[1].unique().numel() for b in batches) / len(batches)
        base = None
        for fmt, label, extra in impls:
            w13, w2 = stacks[fmt]
            cfg = dict(dict(BM=16, BN1=32, BK1=32, BN2=32, BK2=32) if SMOKE else
                       launch.lookup("moe_grouped", moe_fmt_keys(w13), e, h, c), **extra)
            x, ids, wts = batches[0]
            try:
                y = fused_moe(x, ids, wts, w13, w2, mode="grouped", config=cfg)
                ref = reference_moe(x, ids, wts, w13, w2)
                err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                t = timed([lambda b=b, w13=w13, w2=w2, cfg=cfg: fused_moe(*b, w13, w2, mode="grouped", config=cfg)
                           for b in batches])
            except Exception as exc:  # noqa: BLE001
                print(f"  FAIL moe_grouped {label} T={c}: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            base = base or t["us"]
            nbytes = int(active * (payload_bytes(w13) + payload_bytes(w2)) / e)
            rows.append(_row("moe_g", "qwen3-30b-a3b", c, f"ours {label}", t, nbytes, copy_tbps, err, base))
            print(_fmt(rows[-1]), flush=True)
    return rows


def moe_mixed_section(copy_tbps: float, quick: bool) -> list[dict]:
    """Hybrid layouts in one launch pair: Qwen3-30B-A3B with hot experts nvfp4 and cold ones
    nf3 (skewed routing), and DeepSeek-V3 with its shared expert fused as a slot of weight 1,
    against the routed launch plus the shared MLP as three gemv launches."""
    def stack(fmt, n, h, inter, seed=0):
        kw = LUT_FORMATS[fmt]
        return (resolve(random_lut_view(2 * inter, h, lead=(n,), device=DEV, seed=seed, **kw)),
                resolve(random_lut_view(h, inter, lead=(n,), device=DEV, seed=seed + 1, **kw)))

    rows = []
    cells = {"qwen3-30b-a3b": "hybrid"} if quick else {"qwen3-30b-a3b": "hybrid", "deepseek-v3": "shared"}
    for model, kind in cells.items():
        e, top, h, inter = (8, 2, 64, 32) if SMOKE else MOE_MODELS[model]
        if kind == "hybrid":
            hot = 2 if SMOKE else HYBRID_HOT
            g_hot, g_cold = make_group(*stack("nvfp4", hot, h, inter)), make_group(*stack("lut3", e - hot, h, inter, 2))
            layout = hybrid_experts([g_hot, g_cold], [list(range(hot)), list(range(hot, e))])
            per = [payload_bytes(g.w13) / g.size + payload_bytes(g.w2) / g.size for g in (g_hot, g_cold)]
        else:
            hot, n_sh = 0, SHARED[model]
            w13, w2 = stack("nvfp4", e, h, inter)
            kw = LUT_FORMATS["nvfp4"]
            parts = [resolve(random_lut_view(n, k, device=DEV, seed=9 + i, **kw))
                     for i, (n, k) in enumerate(((n_sh * inter, h), (n_sh * inter, h), (h, n_sh * inter)))]
            layout = hybrid_experts([make_group(w13, w2), shared_group(*parts, n_sh)],
                                    [list(range(e)), list(range(e, e + n_sh))])
            per = [(payload_bytes(w13) + payload_bytes(w2)) / e] * 2
        grp = layout.expert_group.tolist()
        for c in MOE_CONCURRENCY:
            batches = _moe_batches(c, e, top, h, hot)
            if kind == "shared":
                batches = [(x, *with_shared_slots(ids, w, e, n_sh)) for x, ids, w in batches]
            active = [b[1].unique().tolist() for b in batches]
            nbytes = int(sum(per[grp[i]] for a in active for i in a) / len(active))
            x, ids, wts = batches[0]
            y = fused_moe_hybrid(x, ids, wts, layout)
            ref = reference_hybrid(x, ids, wts, layout)
            err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
            t = timed([lambda b=b, lay=layout: fused_moe_hybrid(*b, lay) for b in batches])
            label = f"ours nvfp4:{hot}+nf3 tc" if kind == "hybrid" else "ours nvfp4 +shared slot tc"
            rows.append(_row("moe", model, c, label, t, nbytes, copy_tbps, err, None))
            print(_fmt(rows[-1]), flush=True)
            if kind == "shared":  # peer: routed launch, then the shared MLP as three gemvs
                def separate(b, top=top, w13=w13, w2=w2, parts=parts):
                    xs, i2, w2s = b[0], b[1][:, :top], b[2][:, :top]
                    yr = fused_moe(xs, i2, w2s, w13, w2)
                    gu = F.silu(lut_gemv(xs, parts[0])) * lut_gemv(xs, parts[1])
                    return yr + lut_gemv(gu.to(xs.dtype), parts[2])
                t = timed([lambda b=b: separate(b) for b in batches])
                rows.append(_row("moe", model, c, "ours nvfp4 routed tc + shared 3 gemv", t, nbytes,
                                 copy_tbps, None, None))
                print(_fmt(rows[-1]), flush=True)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return rows


ROUTERS = {"qwen3-30b-a3b": (128, 2048, RouterSpec(8)),
           "deepseek-v3": (256, 7168, RouterSpec(8, "sigmoid", True, 8, 4, "top2sum", 2.5))}


def router_section(copy_tbps: float, quick: bool) -> list[dict]:
    """The router op at T = 1, 4, 16, 64 tokens: cuBLAS (a float32 copy of x, then the GEMM)
    + triton_topk, against the Triton gate GEMV + triton_topk (the triton_topk route), and
    triton_gate_topk (one launch) in its one-warp and its four-warp shapes; weights rotate
    through 8 copies (one per layer, as in a decode step)."""
    rows = []
    models = {"tiny": (16, 64, RouterSpec(2))} if SMOKE else ROUTERS
    for model, (e, d, spec) in models.items():
        gates = [torch.randn(e, d, device=DEV) * 0.02 for _ in range(1 if SMOKE else 8)]
        bias = torch.rand(e, device=DEV) * 0.1 if spec.scoring == "sigmoid" else None
        four_warps = dict(BE=min(16, triton.next_power_of_2(triton.cdiv(e, 32))), num_warps=4)
        four_warps["BD"] = max(64, 2048 // four_warps["BE"])

        def cublas(call):
            call.logits = gate_logits(call.x, call.gate_w, call.gate_b)
            return router_op._run_triton(call)

        impls = (("cuBLAS GEMM + triton_topk", cublas),
                 ("gate GEMV + triton_topk", router_op._run_triton),
                 ("triton_gate_topk", router_op._run_fused),
                 ("triton_gate_topk 4 warps", functools.partial(router_op._run_fused, config=four_warps)))
        for t in (1, 4, 16, 64):
            x = torch.randn(t, d, device=DEV, dtype=torch.bfloat16)
            ref = reference_route(gate_logits(x, gates[0]), spec, bias)
            base = None
            for impl, fn in impls:
                if t > router_op.FUSED_MAX_TOKENS and "gate_topk" in impl:
                    continue
                calls = [functools.partial(_route_call, fn, spec, bias, x, g) for g in gates]
                ids, w = calls[0]()
                err = (w - ref[1]).abs().max().item() + float(not torch.equal(ids, ref[0]))
                tm = timed(calls)
                base = base or tm["us"]
                rows.append(_row("router", model, t, impl, tm, e * d * 4, copy_tbps, err, base))
                print(_fmt(rows[-1]), flush=True)
    return rows


def _route_call(fn, spec, bias, x, gate_w):
    return fn(router_op.RouterCall(None, spec, bias, x=x, gate_w=gate_w))


def _row(kind, shape, m, impl, t, nbytes, copy_tbps, err, base) -> dict:
    tbps = nbytes / t["us"] / 1e6
    return {"kind": kind, "shape": shape, "M": m, "impl": impl, **t, "bytes": nbytes,
            "TBps": tbps, "pct_copy": 100 * tbps / copy_tbps, "rel_err": err,
            "speedup_vs_first_peer": base / t["us"] if base else None}


def _fmt(r: dict) -> str:
    err = "" if r["rel_err"] is None else f" err {r['rel_err']:.1e}"
    return (f"{r['kind']:6s} {r['shape']:14s} M={r['M']:<3d} {r['impl']:26s} {r['us']:8.1f} us "
            f"[{r['min_us']:.1f}-{r['max_us']:.1f}] {r['TBps']:.2f} TB/s {r['pct_copy']:5.1f}% copy{err}")


def markdown(result: dict) -> str:
    c = result["ceilings"]
    lines = [f"Device: {result['device']}; commit {result['commit']}; torch {result['torch']}, "
             f"triton {result['triton']}.",
             f"Ceilings: copy {c['copy_TBps']:.2f} TB/s (read + write), bf16 matmul "
             f"{c['bf16_TFLOPs']:.0f} TFLOP/s.", "",
             "| op | shape | M | impl | median us | min-max us | weight TB/s | % copy | vs first peer | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        sp = "" if r["speedup_vs_first_peer"] is None else f"{r['speedup_vs_first_peer']:.2f}x"
        lines.append(f"| {r['kind']} | {r['shape']} | {r['M']} | {r['impl']} | {r['us']:.1f} | "
                     f"{r['min_us']:.1f}-{r['max_us']:.1f} | {r['TBps']:.2f} | {r['pct_copy']:.1f} | {sp} | {err} |")
    return "\n".join(lines) + "\n"


SMOKE_HELP = "tiny shapes on the CPU through the Triton interpreter: checks code paths, not speed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="one linear shape, one MoE model")
    ap.add_argument("--sections", default="linear,moe,moe_mixed,router",
                    help="any of linear, moe, moe_mixed, router, prefill_linear, moe_grouped")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    a = ap.parse_args()
    if a.smoke:
        global DEV, SMOKE
        DEV, SMOKE = "cpu", True
        os.environ["TRITON_INTERPRET"] = "1"
    commit = os.environ.get("LOWBIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(),
              "commit": commit or "unknown",
              "torch": torch.__version__, "triton": triton.__version__, "rows": []}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    result["ceilings"] = ceilings()
    print(f"ceilings: {result['ceilings']['copy_TBps']:.2f} TB/s copy, "
          f"{result['ceilings']['bf16_TFLOPs']:.0f} TFLOP/s bf16", flush=True)
    copy = result["ceilings"]["copy_TBps"]
    sections = {"linear": linear_section, "moe": moe_section, "moe_mixed": moe_mixed_section,
                "router": router_section, "prefill_linear": prefill_linear_section,
                "moe_grouped": moe_grouped_section}
    for name in a.sections.split(","):
        result["rows"] += sections[name](copy, a.quick)
        (out / "kernels.json").write_text(json.dumps(result, indent=1))
        (out / "kernels.md").write_text(markdown(result))
        print(f"section {name} done at {time.time() - t0:.0f} s", flush=True)
    print(markdown(result))


if __name__ == "__main__":
    main()
