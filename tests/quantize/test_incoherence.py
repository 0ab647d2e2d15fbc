"""The randomized Hadamard transform of lowbit.quantize.incoherence: orthogonal, and it helps
rounding where a weight has outlier columns."""

import math

import pytest
import torch

from lowbit.formats import get_format
from lowbit.quantize.gptq_vq import calibrated_rounding
from lowbit.quantize.incoherence import (
    block_size,
    random_signs,
    rotate,
    rotated_rounding,
    unrotate,
    walsh_hadamard,
)


def sylvester(b: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(b)


@pytest.mark.parametrize("k", [64, 192, 256, 768])
def test_transform_is_the_blockwise_hadamard_matrix_and_orthogonal(k):
    b = block_size(k)
    assert b == min(256, k & -k)
    x = torch.randn(5, k, dtype=torch.float64)
    expect = (x.reshape(5, k // b, b) @ sylvester(b).double()).reshape(5, k)
    assert torch.allclose(walsh_hadamard(x, b), expect, atol=1e-12)
    s = random_signs(k, 3)
    t = rotate(torch.eye(k, dtype=torch.float64), s)  # rows: T e_i = column i of T
    assert torch.allclose(t @ t.T, torch.eye(k, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(unrotate(rotate(x, s), s), x, atol=1e-12)


def test_rotated_layer_output_is_exact_before_rounding():
    """W x == (W T^T)(T x): what a runtime rotation of the activations would rely on."""
    w, x, s = torch.randn(16, 192, dtype=torch.float64), torch.randn(7, 192, dtype=torch.float64), random_signs(192, 1)
    assert torch.allclose(rotate(x, s) @ rotate(w, s).T, x @ w.T, atol=1e-10)


def test_rotation_lowers_the_output_error_of_heavy_tails_and_outlier_channels():
    """The case incoherence is for: heavy-tailed weights, a few large activation channels."""
    torch.manual_seed(0)
    w = torch.distributions.StudentT(2.0).sample((64, 256)) * 0.02
    x = torch.randn(2048, 256)
    x[:, [3, 70, 140, 200]] *= 20
    h = x.T @ x / len(x)
    fmt = get_format("nf3")
    err = lambda q: float((x @ (w - q).T).pow(2).mean())
    plain = err(calibrated_rounding(fmt, w, h).dequantize())
    rotated = err(rotated_rounding(fmt, w, h, random_signs(256, 0)))
    assert rotated < 0.25 * plain, (rotated, plain)
    out_side = err(rotated_rounding(fmt, w, h, random_signs(64, 0), side="out"))  # rows mixed, inputs not
    assert rotated < out_side, (rotated, out_side)
