"""Time the vector codebook GEMV (route triton_vq_gemv) on one GPU against its peers.

    python scripts/bench_vq_gemv.py [--shapes 14336x4096,4096x14336,2048x6144] [--m 1,4]

For each weight shape N x K and M: vq2 / vq3 / vq4 through `vq_gemv` (random indices and
scales, the shipped codebooks), nf4 through the LUT gemv (`lut_gemv`), bf16 through
`F.linear`; each checked against its torch twin first, then timed by
`triton.testing.do_bench` (median, microseconds), with the achieved weight bandwidth
(payload bytes / time). Prints a markdown table for docs/BENCHMARKS.md.
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
    return VqWeight(codes, scales, fmt.codebook.cuda().float(), fmt.index_bits, name)


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3  # us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="14336x4096,4096x14336,2048x6144")
    ap.add_argument("--m", default="1,4")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    print("| N x K | M | weight | us | GB/s (weight bytes) | rel err vs twin |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        weights = {name: vq_weight(name, n, k) for name in ("vq2", "vq3", "vq4")}
        weights["nf4 (lut gemv)"] = resolve(get_format("nf4").quantize(dense))
        weights["bf16 F.linear"] = dense
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for name, w in weights.items():
                row = measure(x, w)
                print(f"| {n} x {k} | {m} | {name} | {row[0]:.1f} | {row[1]:.0f} | {row[2]:.1e} |")


def measure(x: torch.Tensor, w) -> tuple[float, float, float]:
    """(median us, weight GB/s, relative error against the twin) of one weight kind."""
    if isinstance(w, VqWeight):
        run, ref, nbytes = (lambda: vq_gemv(x, w)), reference_vq_linear(x, w), w.nbytes
    elif isinstance(w, torch.Tensor):
        run, ref, nbytes = (lambda: F.linear(x, w)), F.linear(x.float(), w.float()), w.numel() * 2
    else:
        run, ref, nbytes = (lambda: lut_gemv(x, w)), reference_linear(x, w), w.nbytes
    y = run()
    err = float((y.float() - ref.float()).norm() / ref.float().norm())
    us = timed(run)
    return us, nbytes / us / 1e3, err

if __name__ == "__main__":
    main()
