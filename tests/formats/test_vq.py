import hashlib

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.formats import get_format
from lowbit.formats.vq import CODEBOOK_FILE, nearest_entries, pack_indices, unpack_indices

from .common import gaussian, sqnr_db
from .vectors import check, floats, load

# docs/FORMATS.md §3.8
CODEBOOK_SHA256 = "2bf5f333b2fae885a9ddb94916bdaf1462bfdc4e8d6a7276bb027334863c587d"
GEOMETRY = {"vq2": (4, 8), "vq3": (4, 12), "vq4": (2, 8)}


@pytest.mark.parametrize("name", sorted(GEOMETRY))
def test_vectors_reproduce_exactly(name):
    assert check(name) >= 10


def test_codebook_file_is_the_documented_one():
    assert hashlib.sha256(CODEBOOK_FILE.read_bytes()).hexdigest() == CODEBOOK_SHA256
    for name, (d, bits) in GEOMETRY.items():
        cb = get_format(name).codebook
        assert cb.dtype == torch.float16 and tuple(cb.shape) == (1 << bits, d)
        assert cb.float().abs().max() < 8  # the encoder's scale cap relies on it
        assert torch.unique(cb.float(), dim=0).shape[0] == 1 << bits  # no dead entries


@pytest.mark.parametrize("name", ["vq2", "vq4"])
def test_scaled_codebook_entries_round_trip_exactly(name):
    case = next(c for c in load(name) if c["name"] == "codebook entries times 1/8")
    assert case["decoded"] == case["input"]


# measured on this matrix: vq2 10.27, vq3 15.91, vq4 21.15 dB; nf3 14.11, lut3 14.95, nf4 20.72
@pytest.mark.parametrize("name,bound", [("vq2", 10.0), ("vq3", 15.6), ("vq4", 20.9)])
def test_gaussian_round_trip(name, bound):
    assert sqnr_db(name, gaussian(128, 512, seed=7)) > bound


def test_vq3_beats_the_scalar_three_bit_formats_at_fewer_bits():
    w = gaussian(128, 512, seed=8)
    assert get_format("vq3").bits_per_weight(tuple(w.shape)) < get_format("lut3").bits_per_weight(tuple(w.shape))
    assert sqnr_db("vq3", w) > sqnr_db("lut3", w) + 0.5  # measured +0.90 dB
    with torch.random.fork_rng():
        torch.manual_seed(9)  # unseeded, nf3 won on some draws
        heavy = torch.distributions.StudentT(4.0).sample((64, 512))
    assert sqnr_db("vq3", heavy) > sqnr_db("nf3", heavy)


@pytest.mark.parametrize("name", sorted(GEOMETRY))
def test_error_bound_per_block(name):
    """No block decodes worse than its scale allows: |w - decoded| <= scale * (the farthest a
    point of the normalised block can be from its nearest entry, bounded by 4 here)."""
    fmt = get_format(name)
    w = gaussian(16, 200, seed=3) * torch.logspace(-2, 2, 200)
    payload = fmt.encode(w)
    err = (fmt.decode(payload, tuple(w.shape)) - w).abs()  # [16, 200]
    s = payload["scales"].float().repeat_interleave(64, -1)[:, :200]
    assert bool((err <= 4 * s + 1e-30).all())
    assert err.pow(2).sum() < 0.2 * w.pow(2).sum()


@pytest.mark.parametrize("bits", [8, 12])
def test_index_packing_round_trips(bits):
    idx = torch.randint(0, 1 << bits, (3, 5, 32), generator=torch.Generator().manual_seed(bits))
    packed = pack_indices(idx, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 32 * bits // 8)
    assert torch.equal(unpack_indices(packed, bits), idx)
    if bits == 12:  # groups 2j, 2j + 1 share bytes 3j..3j+2, low group first
        two = pack_indices(torch.tensor([0xABC, 0x123]), 12)
        assert two.tolist() == [0xBC, 0x3A, 0x12]


def test_nearest_entries_is_the_exact_nearest():
    g = torch.Generator().manual_seed(0)
    cb = torch.randn(300, 4, generator=g)
    x = torch.randn(1000, 4, generator=g)
    brute = (x[:, None, :] - cb[None]).pow(2).sum(-1).argmin(-1)
    assert torch.equal(nearest_entries(x, cb), brute)
    tie = torch.tensor([[0.0, 0, 0, 0]])
    assert nearest_entries(tie, torch.tensor([[1.0, 0, 0, 0], [-1.0, 0, 0, 0]])).item() == 0


def test_payload_shapes_and_padding():
    fmt = get_format("vq3")
    payload = fmt.encode(gaussian(2, 3, 70))
    assert payload["codes"].shape == (2, 3, 128 // 4 * 12 // 8)
    assert payload["scales"].shape == (2, 3, 2) and payload["scales"].dtype == torch.bfloat16
    with pytest.raises(LowbitError, match="needs"):
        fmt.decode(payload, (2, 3, 130))
    w = floats(load("vq3")[0]["input"], [1, 64])  # all zeros: scale 0, decodes to exact zeros
    assert torch.equal(fmt.decode(fmt.encode(w), (1, 64)), w)


def test_expert_stacks_quantize_like_their_experts():
    w = gaussian(3, 8, 64, seed=4)
    fmt = get_format("vq4")
    qt = fmt.quantize(w)
    assert torch.equal(qt[1].dequantize(), fmt.quantize(w[1]).dequantize())
