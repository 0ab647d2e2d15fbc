"""Time the vector codebook GEMV (route triton_vq_gemv) on one GPU against its peers.

    python scripts/bench_vq_gemv.py [--shapes 14336x4096,4096x14336,2048x6144] [--m 1,4]
    python scripts/bench_vq_gemv.py --moe [--tokens 1,4,16]

For each weight shape N x K and M: vq2 / vq3 / vq4 through `vq_gemv` (random indices and
scales, the shipped codebooks; the packed block kernel at its default config, at BB 2, with
no split-K, and the float32-gather kernel), nf4 through the LUT gemv (`lut_gemv`), bf16 through
`F.linear`; each checked against its torch twin first, then timed by
`triton.testing.do_bench` (median, microseconds), with the achieved weight bandwidth
(payload bytes / time). Prints a markdown table for docs/BENCHMARKS.md.

--moe: the MoE layer at the Qwen3-30B-A3B expert shape (128 experts, H 2048, I 768, top-8)
at T tokens (random routing, distinct experts per token): vq3 / vq4 stacks through the
per-slot vq kernels (route triton_vq_moe), nvfp4 through the default route, bf16 through
the default route; bytes are the distinct experts' payload read.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing
from torch.nn import functional as F

from lowbit.formats import get_format
from lowbit.kernels.dequant_gemm import lut_gemv, reference_linear
from lowbit.kernels.vq_gemv import reference_vq_linear, vq_gemv
from lowbit.kernels.weights import VqWeight, resolve


def vq_weight(name: str, n: int, k: int) -> VqWeight:
    fmt = get_format(name)
    spec = fmt.payload_spec((n, k))
    codes = torch.randint(0, 256, spec["codes"][0], dtype=torch.uint8, device="cuda")
    scales = (torch.rand(spec["scales"][0], device="cuda") * 0.02).to(torch.bfloat16)
    return VqWeight(codes, scales, fmt.codebook.cuda().float(), fmt.index_bits, name, fmt.packed_codebook.cuda())


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3  # us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="14336x4096,4096x14336,2048x6144")
    ap.add_argument("--m", default="1,4")
    ap.add_argument("--moe", action="store_true", help="the MoE layer instead of the gemv")
    ap.add_argument("--tokens", default="1,4,16", help="--moe: token counts")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    if args.moe:
        return moe_main([int(v) for v in args.tokens.split(",")])
    print("| N x K | M | weight | us | GB/s (weight bytes) | rel err vs twin |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        weights = {}
        for name in ("vq2", "vq3", "vq4"):  # the packed block kernel: default, BB 2, no split; float32 gathers
            w = vq_weight(name, n, k)
            weights[f"{name}"] = (w, {})
            weights[f"{name} BB 2"] = (w, {"BB": 2})
            weights[f"{name} SPLIT_K 1"] = (w, {"SPLIT_K": 1})
            weights[f"{name} f32 gathers"] = (w, {"PACKED": False})
        weights["nf4 (lut gemv)"] = resolve(get_format("nf4").quantize(dense))
        weights["bf16 F.linear"] = dense
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for name, w in weights.items():
                row = measure(x, w)
                print(f"| {n} x {k} | {m} | {name} | {row[0]:.1f} | {row[1]:.0f} | {row[2]:.1e} |")


def measure(x: torch.Tensor, w) -> tuple[float, float, float]:
    """(median us, weight GB/s, relative error against the twin) of one weight kind (a vq
    weight comes with its config)."""
    if isinstance(w, tuple):
        w, cfg = w
        run, ref, nbytes = (lambda: vq_gemv(x, w, config=cfg)), reference_vq_linear(x, w), w.nbytes
    elif isinstance(w, torch.Tensor):
        run, ref, nbytes = (lambda: F.linear(x, w)), F.linear(x.float(), w.float()), w.numel() * 2
    else:
        run, ref, nbytes = (lambda: lut_gemv(x, w)), reference_linear(x, w), w.nbytes
    y = run()
    err = float((y.float() - ref.float()).norm() / ref.float().norm())
    us = timed(run)
    return us, nbytes / us / 1e3, err

def moe_main(tokens: list[int]) -> None:
    from lowbit.kernels.moe import reference_moe
    from lowbit.kernels.moe_op import moe_experts
    from lowbit.kernels.vq_moe import vq_moe

    e, h, inter, a = 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * inter, h, device="cuda", generator=g) * 0.02
    w2 = torch.randn(e, h, inter, device="cuda", generator=g) * 0.02
    stacks = {f: (get_format(f).quantize(w13), get_format(f).quantize(w2)) for f in ("vq3", "vq4", "nvfp4")}
    stacks["bf16"] = (w13.bfloat16(), w2.bfloat16())
    print("| T | experts | us | GB/s (distinct experts' bytes) | rel err vs twin |")
    print("|---|---|---|---|---|")
    for t in tokens:
        x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:a] for _ in range(t)]).int()
        w = torch.rand(t, a, device="cuda", generator=g)
        distinct = len(torch.unique(ids))
        rows = [(name, q, None) for name, q in stacks.items()]
        rows[2:2] = [(f"{f} f32 gathers", stacks[f], {"PACKED": False}) for f in ("vq3", "vq4")]
        for name, (q13, q2), cfg in rows:
            if name.startswith("vq"):
                r13, r2 = resolve(q13), resolve(q2)
                run = (lambda x=x, ids=ids, w=w, r13=r13, r2=r2, cfg=cfg: vq_moe(x, ids, w, r13, r2, config=cfg))
                per_expert = (r13.nbytes + r2.nbytes) / e
            else:
                run = (lambda x=x, ids=ids, w=w, q13=q13, q2=q2: moe_experts(x, ids, w, q13, q2))
                per_expert = (q13.nbytes + q2.nbytes) / e  # QuantizedTensor and Tensor both count their bytes
            ref = reference_moe(x, ids, w, resolve(q13), resolve(q2))
            y = run()
            err = float((y.float() - ref.float()).norm() / ref.float().norm())
            us = timed(run)
            print(f"| {t} | {name} | {us:.1f} | {distinct * per_expert / us / 1e3:.0f} | {err:.1e} |")


if __name__ == "__main__":
    main()
