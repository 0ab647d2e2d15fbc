import pytest
import torch

from lowbit.formats.codes import (
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    floor_log2,
    nearest_code,
    pack_codes,
    unpack_codes,
)


def test_four_bit_packing_puts_even_codes_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0, 3, 4, 5, 6]], dtype=torch.uint8)
    packed = pack_codes(codes, 4)
    assert packed.tolist() == [[0x21, 0x0F, 0x43, 0x65]]
    assert torch.equal(unpack_codes(packed, 4), codes)


def test_three_bit_packing_matches_the_spec_bytes():
    # v = sum(i << 3i) = 0o76543210 = 0xFAC688 -> bytes 88 C6 FA
    codes = torch.arange(8, dtype=torch.uint8)[None]
    assert pack_codes(codes, 3).tolist() == [[0x88, 0xC6, 0xFA]]
    codes = torch.tensor([[7, 0, 0, 0, 0, 0, 0, 1]], dtype=torch.uint8)
    assert pack_codes(codes, 3).tolist() == [[0x07, 0x00, 0x20]]


@pytest.mark.parametrize("bits", [3, 4])
def test_packing_round_trips_with_leading_dims(bits):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 1 << bits, (2, 3, 64), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (2, 3, 64 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_nearest_code_breaks_ties_to_the_even_index():
    grid = torch.tensor([0.0, 1.0, 2.0, 3.0])
    x = torch.tensor([0.5, 1.5, 2.5, -9.0, 9.0, 1.4999, 1.5001])
    assert nearest_code(x, grid).tolist() == [0, 2, 2, 0, 3, 1, 2]
    rows = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 10.0, 20.0, 30.0]])
    xs = torch.tensor([[0.5, 2.5], [5.0, 15.0]])
    assert nearest_code(xs, rows).tolist() == [[0, 2], [0, 2]]


def test_e2m1_all_codes_and_rounding():
    values = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist() == values
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1, -5.0, 1e30])
    assert e2m1_decode(e2m1_encode(x)).tolist() == [0, 1, 1, 2, 2, 4, 4, 6, 0, -4, 6]
    assert e2m1_encode(torch.tensor([-0.1])).item() == 0  # never -0


def test_e8m0_is_an_exact_power_of_two_with_nan_at_255():
    b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = e8m0_decode(b)
    assert got[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(got[6])


def test_floor_log2_is_exact_for_subnormals_and_powers_of_two():
    x = torch.tensor([2.0**-149, 2.0**-130 * 1.5, 0.999, 1.0, 7.99, 8.0, 3e38])
    assert floor_log2(x).tolist() == [-149, -130, -1, 0, 2, 3, 127]
