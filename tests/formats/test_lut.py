import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.formats import get_format, lut_view_decode

from .common import gaussian, sqnr_db
from .vectors import check


@pytest.mark.parametrize("name", ["lut4", "lut3"])
def test_vectors_reproduce_exactly(name):
    assert check(name) >= 10


@pytest.mark.parametrize("name,nf,gain", [("lut4", "nf4", 0.2), ("lut3", "nf3", 0.5)])
def test_fitted_table_beats_the_normal_float_table(name, nf, gain):
    w = gaussian(256, 1024)
    assert sqnr_db(name, w) > sqnr_db(nf, w) + gain  # measured +0.4 / +0.9 dB
    heavy = torch.distributions.StudentT(3.0).sample((256, 512))
    assert sqnr_db(name, heavy) > sqnr_db(nf, heavy) + gain


def test_importance_moves_accuracy_to_the_important_columns():
    w = gaussian(64, 256)
    imp = torch.ones(256)
    imp[:64] = 100.0
    fmt = get_format("lut3")
    plain = (fmt.decode(fmt.encode(w), (64, 256)) - w)[:, :64].pow(2).mean()
    weighted = (fmt.decode(fmt.encode(w, importance=imp), (64, 256)) - w)[:, :64].pow(2).mean()
    assert weighted < plain


def test_row_groups_get_their_own_tables():
    w = gaussian(600, 64)
    w[256:512] = torch.sign(w[256:512])  # a group of +-1 only: its table must hold +-1
    fmt = get_format("lut4")
    payload = fmt.encode(w)
    assert payload["table"].shape == (3, 16)
    assert payload["table_index"].tolist() == [n // 256 for n in range(600)]
    assert torch.isin(torch.tensor([-1.0, 1.0]), payload["table"][1]).all()
    view = fmt.lut_view(payload)
    assert view.table.shape == (3, 16) and view.table_index is payload["table_index"]
    assert torch.equal(lut_view_decode(view), fmt.decode(payload, (600, 64)))


def test_stacked_experts_index_a_flat_table_list():
    fmt = get_format("lut3")
    payload = fmt.encode(gaussian(2, 300, 64))
    view = fmt.lut_view(payload)
    assert view.table.shape == (4, 8)
    assert view.table_index[1].tolist() == [2 + n // 256 for n in range(300)]


def test_bad_arguments_are_refused():
    fmt = get_format("lut4")
    with pytest.raises(LowbitError, match="importance"):
        fmt.encode(gaussian(2, 64), importance=torch.ones(3))
    with pytest.raises(LowbitError, match="non-negative"):
        fmt.encode(gaussian(2, 64), importance=torch.full((64,), float("nan")))
    with pytest.raises(LowbitError, match="table"):
        fmt.encode(gaussian(2, 64), table=torch.zeros(2, 16))
