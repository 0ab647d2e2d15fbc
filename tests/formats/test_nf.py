import pytest
import torch

from lowbit.formats import get_format
from lowbit.formats.nf import NF3_TABLE, NF4_TABLE, normal_float_table

from .common import gaussian, sqnr_db
from .vectors import check


@pytest.mark.parametrize("name", ["nf4", "nf3"])
def test_vectors_reproduce_exactly(name):
    assert check(name) >= 10


def test_tables_follow_the_normal_float_construction():
    nf4 = torch.tensor(NF4_TABLE)
    assert (normal_float_table(16) - nf4).abs().max() < 2.5e-7  # the published rounding
    assert normal_float_table(8).tolist() == list(NF3_TABLE)
    for t in (NF4_TABLE, NF3_TABLE):
        assert t[0] == -1.0 and t[-1] == 1.0 and 0.0 in t and list(t) == sorted(t)


@pytest.mark.parametrize("name,bound", [("nf4", 20.3), ("nf3", 13.7)])
def test_gaussian_round_trip(name, bound):
    assert sqnr_db(name, gaussian(256, 1024)) > bound  # measured 20.7 / 14.1


@pytest.mark.parametrize("name", ["nf4", "nf3"])
def test_decoded_values_lie_on_the_scaled_table(name):
    fmt = get_format(name)
    w = gaussian(4, 64)
    payload = fmt.encode(w)
    ratio = fmt.decode(payload, (4, 64)) / payload["scales"].float()
    assert (ratio[..., None] - fmt.table).abs().amin(-1).max() < 1e-6
    assert torch.equal(payload["scales"].float()[:, 0], w.abs().amax(1).bfloat16().float())


def test_nf3_packs_eight_codes_in_three_bytes():
    payload = get_format("nf3").encode(gaussian(2, 64))
    assert payload["codes"].shape == (2, 24)
