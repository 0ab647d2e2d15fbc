"""Write lowbit/formats/vq_codebooks.safetensors: the fixed codebooks of vq2, vq3, vq4.

Each codebook is Lloyd's k-means (float32 distances, float64 centroid sums) over D-dim
groups of Gaussian blocks of 64 weights, each block divided by its root mean square (the
encoder's first scale), started from C distinct samples and run for a fixed number of
steps, then rounded to float16. Deterministic on the CPU for a given torch build; the
shipped file is the normative one (sha256 in docs/FORMATS.md), this is how it was made.

    python scripts/gen_vq_codebooks.py [--only vq2] [--out PATH]
"""

from __future__ import annotations

import argparse
import time

import torch
from safetensors.torch import load_file, save_file

from lowbit.formats.vq import CODEBOOK_FILE

# name -> (D, index bits, Gaussian blocks of 64, Lloyd steps)
RECIPES = {"vq2": (4, 8, 20000, 30), "vq3": (4, 12, 10000, 16), "vq4": (2, 8, 20000, 30)}
CHUNK = 1 << 16


def samples(blocks: int, d: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(blocks, 64, generator=g, dtype=torch.float64)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    return x.reshape(-1, d).float()  # [blocks * 64 / D, D]


def kmeans(x: torch.Tensor, c: int, steps: int, g: torch.Generator) -> torch.Tensor:
    cb = x[torch.randperm(x.shape[0], generator=g)[:c]].clone()  # [C, D]
    for step in range(steps):
        norms = cb.pow(2).sum(-1)
        idx = torch.empty(x.shape[0], dtype=torch.long)
        err = 0.0
        for s in range(0, x.shape[0], CHUNK):
            xs = x[s:s + CHUNK]
            v, i = (norms[None] - 2 * xs @ cb.T).min(-1)
            idx[s:s + CHUNK] = i
            err += float((v + xs.pow(2).sum(-1)).sum())
        cnt = torch.bincount(idx, minlength=c).double()
        sums = torch.zeros(c, x.shape[1], dtype=torch.float64).index_add_(0, idx, x.double())
        cb = torch.where(cnt[:, None] > 0, sums / cnt.clamp(min=1)[:, None], cb.double()).float()
        print(f"  step {step:2d}: mse {err / x.numel():.6f}", flush=True)
    return cb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(RECIPES))
    ap.add_argument("--out", default=str(CODEBOOK_FILE))
    args = ap.parse_args()
    try:
        books = load_file(args.out)
    except FileNotFoundError:
        books = {}
    for name, (d, bits, blocks, steps) in RECIPES.items():
        if args.only and name != args.only:
            continue
        t0 = time.time()
        print(f"{name}: D={d}, C={1 << bits}, {blocks} blocks, {steps} steps")
        g = torch.Generator().manual_seed(0)
        books[name] = kmeans(samples(blocks, d, g), 1 << bits, steps, g).half().contiguous()
        print(f"  {time.time() - t0:.0f} s")
    save_file(dict(sorted(books.items())), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
