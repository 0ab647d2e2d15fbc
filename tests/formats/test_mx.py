import math

import pytest
import torch

from lowbit.formats import get_format

from .common import gaussian, sqnr_db
from .vectors import check


@pytest.mark.parametrize("name", ["mxfp4", "mxfp8"])
def test_vectors_reproduce_exactly(name):
    assert check(name) >= 10


@pytest.mark.parametrize("name,emax", [("mxfp4", 2), ("mxfp8", 8)])
def test_scale_exponent_is_floor_log2_amax_minus_emax(name, emax):
    w = gaussian(4, 96) * torch.logspace(-20, 20, 96, base=2.0)
    payload = get_format(name).encode(w)
    for n in range(4):
        for b in range(3):
            amax = float(w[n, 32 * b : 32 * b + 32].abs().max())
            expect = math.frexp(amax)[1] - 1 - emax + 127
            assert int(payload["scales"][n, b]) == expect


@pytest.mark.parametrize("name,bound", [("mxfp4", 18.3), ("mxfp8", 30.0)])
def test_gaussian_round_trip(name, bound):
    assert sqnr_db(name, gaussian(256, 1024)) > bound  # measured 18.8 / 30.6


def test_mxfp4_hand_built_payload_decodes_by_the_spec():
    codes = torch.full((1, 16), 0x21, dtype=torch.uint8)  # element 2j = 0.5, 2j+1 = 1.0
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2**1
    d = get_format("mxfp4").decode({"codes": codes, "scales": scales}, (1, 32))
    assert d[0, :4].tolist() == [1.0, 2.0, 1.0, 2.0]


def test_mxfp8_k_padding_is_zero_and_cropped():
    w = gaussian(3, 40)
    fmt = get_format("mxfp8")
    payload = fmt.encode(w)
    assert payload["codes"].shape == (3, 64)
    assert payload["codes"][:, 40:].float().eq(0).all()
    assert fmt.decode(payload, (3, 40)).shape == (3, 40)
