import pytest
import torch

from lowbit.formats import get_format

from .common import gaussian, sqnr_db
from .vectors import check


@pytest.mark.parametrize("name", ["fp8", "fp8-block"])
def test_vectors_reproduce_exactly(name):
    assert check(name) >= 10


def all_e4m3_values() -> torch.Tensor:
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v[~v.isnan()]  # 254 finite values, amax 448


@pytest.mark.parametrize("name", ["fp8", "fp8-block"])
@pytest.mark.parametrize("scale", [1.0, 2.0**-9, 2.0**20])
def test_representable_values_round_trip_exactly(name, scale):
    w = all_e4m3_values()[None] * scale  # amax 448 * scale -> scale is exactly `scale`
    qt = get_format(name).quantize(w)
    assert torch.equal(qt.dequantize(), w)


@pytest.mark.parametrize("name", ["fp8", "fp8-block"])
def test_round_trip_error_is_within_half_an_e4m3_step(name):
    w = gaussian(64, 300)
    fmt = get_format(name)
    payload = fmt.encode(w)
    d = fmt.decode(payload, tuple(w.shape))
    s = payload["scales"].amax()
    # relative step 2**-3 for normals, absolute step 2**-9 * s below 2**-6 * s
    bound = torch.maximum(w.abs() * 2.0**-4, torch.full_like(w, float(s) * 2.0**-10))
    assert ((d - w).abs() <= bound * (1 + 2.0**-20)).all()
    assert sqnr_db(name, w) > 31.0


def test_fp8_scale_is_row_amax_over_448():
    w = gaussian(5, 77)
    payload = get_format("fp8").encode(w)
    assert torch.equal(payload["scales"][:, 0], w.abs().amax(1) / 448)
    assert payload["codes"].float().abs().amax(1).eq(448).all()


def test_fp8_block_scales_follow_partial_128_tiles():
    w = gaussian(130, 260)
    w[128:, 256:] *= 100  # the corner tile is 2 x 4
    payload = get_format("fp8-block").encode(w)
    assert payload["scales"].shape == (2, 3)
    assert payload["scales"][1, 2] == w[128:, 256:].abs().amax() / 448
    assert payload["scales"][0, 0] == w[:128, :128].abs().amax() / 448
    assert sqnr_db("fp8-block", w) > 31.0
