"""Incoherence processing (a randomized Hadamard transform of a weight's input dimension
before rounding), measured and not shipped: no artifact or op route applies it.

Shape legend: L leading dims (stacked experts), N rows, K input columns, b the transform's
block (the largest power of two <= MAX_BLOCK dividing K).

T = H D: D = diag(s), s random signs [K]; H block-diagonal over K / b orthonormal
Walsh-Hadamard (Sylvester) matrices of size b. T is orthogonal, so W x = (W T^T) (T x):
rounding W' = W T^T (GPTQ on the rotated Hessian T H T^T) and multiplying T x at run time
gives the layer's output up to rounding, with the weights' large entries spread over each
block. `rotated_rounding` returns the dense weight such a layer computes with, Q(W') T,
which `measure` swaps into the unquantized model to score the KL to it on held-out text
without a runtime path. An expert stack's FC2 (w2) input is the per-slot activation, which
only the fused kernels see; `measure` scores three choices for it: rotated like every input
("all", needs the kernels), left unrotated ("skip"), or rotated on its output rows ("out",
W2' = T W2, undone once per token after the combine). docs/BENCHMARKS.md ("Incoherence
processing") has the result and the command.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import Tensor

from lowbit.checkpoint.hf import resolve_model_dir
from lowbit.checkpoint.loader import load_model
from lowbit.checkpoint.quant_plan import plan_quantization, swappable
from lowbit.checkpoint.tokenizer import Tokenizer
from lowbit.formats import Format, get_format
from lowbit.quantize.calibrate import collect_hessians
from lowbit.quantize.gptq_vq import calibrated_rounding
from lowbit.quantize.sensitivity import KLProbe

MAX_BLOCK = 256


def block_size(k: int) -> int:
    """The transform's block for K columns: the largest power of two <= MAX_BLOCK dividing K."""
    b = 1
    while k % (2 * b) == 0 and 2 * b <= MAX_BLOCK:
        b *= 2
    return b


def walsh_hadamard(x: Tensor, b: int) -> Tensor:
    """Orthonormal Walsh-Hadamard transform of each block of b (a power of two) along the last dim."""
    shape = x.shape
    y = x.reshape(-1, shape[-1] // b, b)
    h = 1
    while h < b:
        y = y.reshape(*y.shape[:2], b // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), -2)
        h *= 2
    return (y.reshape(shape) / math.sqrt(b)).to(x.dtype)


def random_signs(k: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (k,), generator=g).float() * 2 - 1


def rotate(x: Tensor, signs: Tensor) -> Tensor:
    """T x for x [..., K]: signs, then the blockwise Walsh-Hadamard transform."""
    return walsh_hadamard(x * signs, block_size(x.shape[-1]))


def unrotate(y: Tensor, signs: Tensor) -> Tensor:
    """T^T y (the Walsh-Hadamard matrix is symmetric and its own inverse)."""
    return walsh_hadamard(y, block_size(y.shape[-1])) * signs


def rotated_rounding(fmt: Format, w: Tensor, h: Tensor, signs: Tensor, damp: float = 0.01,
                     side: str = "in") -> Tensor:
    """The dense float32 weight [.., N, K] a layer computes with when w [.., N, K] is rounded
    in `fmt` after rotation: side "in" rotates the input dim (h [.., K, K] rotated alike,
    signs [K]), "out" the rows (signs [N]; h as it is)."""
    w = w.float()
    if side == "out":
        wr = rotate(w.transpose(-1, -2), signs).transpose(-1, -2)  # T W
        q = calibrated_rounding(fmt, wr, h, damp).dequantize()
        return unrotate(q.transpose(-1, -2), signs).transpose(-1, -2)
    hr = rotate(rotate(h.float(), signs).transpose(-1, -2), signs)  # T H T^T (H symmetric)
    q = calibrated_rounding(fmt, rotate(w, signs), hr, damp).dequantize()
    return unrotate(q, signs)


def measure(fmt_name: str, w2: str, heldout: str, tokens: int, calib: str, seed: int = 0) -> float:
    """KL of the demo model with every Linear and expert stack GPTQ-rounded in fmt_name, with
    (w2 = all / skip / out) or without (w2 = none) rotation, to the unquantized model on the
    first `tokens` tokens of `heldout` (windows of 512)."""
    path = resolve_model_dir("demo")
    model = load_model(path, dtype="float32", device="cpu").model
    tok = Tokenizer(path)
    fmt = get_format(fmt_name)
    sums = collect_hessians(model, plan_quantization(model, fmt_name, False),
                            tok.encode(open(calib, encoding="utf-8").read()), "cpu", 2048)
    probe = KLProbe.build(model, tok.encode(open(heldout, encoding="utf-8").read())[:tokens], "cpu",
                          tokens=tokens, window=512)
    for i, (pname, (mod, attr)) in enumerate(swappable(model).items()):
        w, h = getattr(mod, attr).data, sums.mean(pname)
        is_w2 = pname.endswith(".w2")
        if w2 == "none" or (is_w2 and w2 == "skip"):
            getattr(mod, attr).data = calibrated_rounding(fmt, w, h).dequantize()
        elif is_w2 and w2 == "out":
            getattr(mod, attr).data = rotated_rounding(fmt, w, h, random_signs(w.shape[-2], seed + i), side="out")
        else:
            getattr(mod, attr).data = rotated_rounding(fmt, w, h, random_signs(w.shape[-1], seed + i))
    return probe.kl()


def main() -> None:
    p = argparse.ArgumentParser(description="KL of GPTQ roundings of the demo model with and without "
                                            "a randomized Hadamard transform of each weight's input")
    p.add_argument("--formats", default="nf3,nf4")
    p.add_argument("--text", default="data/demo_corpus/heldout.txt")
    p.add_argument("--calib", default="lowbit/demo_model/calibration.txt")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--seeds", type=int, default=1)
    args = p.parse_args()
    for name in args.formats.split(","):
        for w2 in ("none", "skip", "out", "all"):
            for seed in range(1 if w2 == "none" else args.seeds):
                kl = measure(name, w2, args.text, args.tokens, args.calib, 1000 * seed)
                print(f"{name} rotation={'off' if w2 == 'none' else 'on'} w2={w2} seed={seed}: KL {kl:.5f}", flush=True)


if __name__ == "__main__":
    main()
