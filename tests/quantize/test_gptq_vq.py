"""Vector GPTQ (lowbit/quantize/gptq_vq.py) against nearest rounding on correlated inputs."""

import pytest
import torch

from lowbit.formats import get_format
from lowbit.quantize.allocate import round_weight
from lowbit.quantize.gptq_vq import calibrated_rounding, gptq_quantize_vq, has_calibrated_rounding

from .test_gptq import K, N, correlated_inputs, output_error

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small ops: one thread (conftest)


@pytest.fixture(scope="module")
def layer():
    x = correlated_inputs()
    w = torch.randn(2, N, K, generator=torch.Generator().manual_seed(1)) * 0.05
    return x, w, x.T @ x


@pytest.mark.parametrize("name", ["vq2", "vq3", "vq4"])
def test_vector_gptq_beats_nearest_on_outputs(layer, name):
    x, w, h = layer
    fmt = get_format(name)
    qt = gptq_quantize_vq(fmt, w, h.expand(2, K, K))
    fmt.check_payload(qt.payload, qt.shape)
    got = qt.dequantize()
    assert got.shape == w.shape and bool(torch.isfinite(got).all())
    nearest = fmt.quantize(w).dequantize()
    assert output_error(x, w, got) < 0.95 * output_error(x, w, nearest)  # measured 0.89-0.94


def test_identity_hessian_gives_nearest_rounding_quality(layer):
    _, w, _ = layer
    fmt = get_format("vq4")
    qt = gptq_quantize_vq(fmt, w[0], torch.eye(K))
    err = (qt.dequantize() - w[0]).pow(2).sum()
    nearest = (fmt.quantize(w[0]).dequantize() - w[0]).pow(2).sum()
    assert err < 1.05 * nearest  # no correlations: nothing to feed back, same error


def test_dead_columns_decode_to_zero_and_dispatch(layer):
    x, w, h = layer
    h = h.clone()
    h[:, 7] = 0
    h[7, :] = 0
    qt = calibrated_rounding(get_format("vq2"), w[0], h)
    assert qt.shape == (N, K)
    assert has_calibrated_rounding(get_format("vq3")) and has_calibrated_rounding(get_format("nf4"))
    assert not has_calibrated_rounding(get_format("fp8"))
    same = round_weight(get_format("vq2"), w[0], h, 0.01)  # the --bpw allocator's path
    assert torch.equal(same.payload["codes"], qt.payload["codes"])
    shared = calibrated_rounding(get_format("vq4"), w, h)  # one [K, K] Hessian for a stack
    assert shared.shape == w.shape and torch.isfinite(shared.dequantize()).all()


@pytest.mark.parametrize("name", ["nvfp4", "lut3", "int4-g32", "vq3"])
def test_stack_rounded_in_slices_is_the_stack_rounded_at_once(layer, name, monkeypatch):
    """Expert stacks above MATRICES_PER_CALL go in slices: the same payload, field by field."""
    import lowbit.quantize.gptq_vq as gv

    _, w, h = layer
    stack = torch.cat([w, w.flip(1), 0.5 * w])  # [6, N, K]
    hs = torch.stack([h * (1 + i / 6) for i in range(6)])  # a Hessian per matrix
    fmt = get_format(name)
    whole = [calibrated_rounding(fmt, stack, hh) for hh in (hs, h)]  # per matrix, shared
    monkeypatch.setattr(gv, "MATRICES_PER_CALL", 4)  # slices of 4 and 2
    for hh, ref in zip((hs, h), whole):
        sliced = calibrated_rounding(fmt, stack, hh)
        assert sliced.shape == ref.shape and sliced.payload.keys() == ref.payload.keys()
        assert all(torch.equal(sliced.payload[k], ref.payload[k]) for k in ref.payload)
