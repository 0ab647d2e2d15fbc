import torch

from lowbit.formats import get_format

from .common import gaussian, sqnr_db
from .vectors import check


def test_vectors_reproduce_exactly():
    assert check("nvfp4") >= 10


def test_gaussian_relative_mse_is_below_one_percent():
    w = gaussian(256, 1024)
    d = get_format("nvfp4").quantize(w).dequantize()
    assert float((d - w).pow(2).mean() / w.pow(2).mean()) < 0.0095  # measured 0.0091


def test_global_scale_is_amax_over_2688_per_expert():
    w = torch.stack([gaussian(8, 64), gaussian(8, 64, seed=1) * 1000])
    payload = get_format("nvfp4").encode(w)
    assert payload["global_scale"].shape == (2,)
    assert torch.equal(payload["global_scale"], w.abs().amax((1, 2)) / 2688)
    # each expert keeps its own precision despite the 1000x gap
    for e in range(2):
        assert sqnr_db("nvfp4", w[e]) > 19.5
    d = get_format("nvfp4").decode(payload, tuple(w.shape))
    assert float((d[0] - w[0]).pow(2).sum() / w[0].pow(2).sum()) < 0.015


def test_the_largest_weight_survives_to_two_ulp():
    w = gaussian(16, 64) * 3.7
    d = get_format("nvfp4").quantize(w).dequantize()
    i = w.abs().argmax()
    assert abs(float(d.reshape(-1)[i] - w.reshape(-1)[i])) <= float(w.abs().max()) * 2.0**-22


def test_hand_built_payload_decodes_by_the_spec():
    # codes 0x3A: low nibble 0xA = -1.0, high nibble 0x3 = 1.5; scale e4m3 2.0; g = 0.5
    codes = torch.full((1, 8), 0x3A, dtype=torch.uint8)
    scales = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)
    payload = {"codes": codes, "scales": scales, "global_scale": torch.tensor(0.5)}
    d = get_format("nvfp4").decode(payload, (1, 16))
    assert d[0, :4].tolist() == [-1.0, 1.5, -1.0, 1.5]


def test_a_zero_block_has_zero_scale_and_codes():
    w = torch.cat([torch.zeros(2, 16), gaussian(2, 16)], 1)
    payload = get_format("nvfp4").encode(w)
    assert payload["scales"][:, 0].float().eq(0).all()
    assert payload["codes"][:, :8].eq(0).all()
