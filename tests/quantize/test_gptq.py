"""GPTQ rounding against round-to-nearest on a random layer with correlated inputs."""

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.formats import SCALAR_FORMATS, get_format
from lowbit.quantize.gptq import gptq_quantize

N, K, T = 48, 136, 1024  # K not a multiple of any block: the last block pads


def correlated_inputs(seed: int = 0) -> torch.Tensor:
    """[T, K] inputs with strongly correlated columns and uneven scales, as hidden states have."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(K, K, generator=g) / K**0.5
    scale = torch.linspace(0.2, 3.0, K)
    return (torch.randn(T, K, generator=g) @ mix + 0.2 * torch.randn(T, K, generator=g)) * scale


def output_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    return float((x @ (w - q).transpose(-1, -2)).norm())


@pytest.fixture(scope="module")
def layer():
    x = correlated_inputs()
    w = torch.randn(2, N, K, generator=torch.Generator().manual_seed(1)) * 0.05
    return x, w, x.T @ x


@pytest.mark.parametrize("name", SCALAR_FORMATS)
def test_gptq_beats_nearest_on_outputs(layer, name):
    x, w, h = layer
    fmt = get_format(name)
    qt = gptq_quantize(fmt, w, h.expand(2, K, K))
    fmt.check_payload(qt.payload, qt.shape)  # the canonical payload, shapes and dtypes
    got = qt.dequantize()
    assert got.shape == w.shape and bool(torch.isfinite(got).all())
    nearest = fmt.quantize(w).dequantize()
    assert output_error(x, w, got) < 0.92 * output_error(x, w, nearest), name
    assert qt.nbytes == fmt.quantize(w).nbytes


@pytest.mark.parametrize("name", ["nvfp4", "nf4", "int4-g32", "lut3"])
def test_gptq_payload_is_the_lut_view(layer, name):
    """The payload decodes the same through the format and through its LUT view, and a
    single matrix gives what the same matrix gives inside a stack."""
    from lowbit.formats import lut_view_decode

    x, w, h = layer
    fmt = get_format(name)
    qt = gptq_quantize(fmt, w[0], h)
    assert torch.equal(lut_view_decode(qt.lut_view())[:, :K], qt.dequantize())
    stacked = gptq_quantize(fmt, w, h.expand(2, K, K))
    assert torch.equal(stacked[0].dequantize(), qt.dequantize())


def test_identity_hessian_keeps_nearest_error_scale(layer):
    """With H = I there is no correlation to exploit: the weight error stays near nearest's."""
    _, w, _ = layer
    fmt = get_format("nf4")
    qt = gptq_quantize(fmt, w[0], torch.eye(K))
    err = float((qt.dequantize() - w[0]).norm())
    ref = float((fmt.quantize(w[0]).dequantize() - w[0]).norm())
    assert err < 1.1 * ref


def test_dead_columns_and_refusals(layer):
    x, w, h = layer
    h = h.clone()
    h[:, 5] = 0
    h[5, :] = 0  # column 5 never sees input: it is zeroed, the rest still rounds
    qt = gptq_quantize(get_format("nvfp4"), w[0], h)
    assert bool((qt.dequantize()[:, 5] == 0).all())
    with pytest.raises(LowbitError, match="scalar formats"):
        gptq_quantize(get_format("fp8"), w[0], h)
