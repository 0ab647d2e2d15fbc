"""Cutting weights for tensor / expert parallel ranks: a quantized shard decodes to exactly
the matching slice of the whole weight, cuts inside a block are refused by name."""

from __future__ import annotations

import pytest
import torch

from lowbit.distributed.slicing import ShardSpec, Split, cat, narrow, take, take_piece
from lowbit.errors import LowbitError
from lowbit.formats import FORMATS

torch.set_num_threads(1)
L, N, K = 2, 512, 256  # two experts; N holds two lut row groups and four fp8-block tiles


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return torch.randn(L, N, K, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=sorted(FORMATS))
def quantized(request, weight):
    return FORMATS[request.param].quantize(weight)


@pytest.mark.parametrize("dim,parts", [(-2, 2), (-2, 4), (-1, 2), (0, 2)])
def test_shards_decode_to_slices_of_the_whole(quantized, dim, parts):
    whole = quantized.dequantize()
    size = quantized.shape[dim] // parts
    pieces = [narrow(quantized, dim, r * size, size, "w") for r in range(parts)]
    for r, piece in enumerate(pieces):
        assert torch.equal(piece.dequantize(), whole.narrow(dim, r * size, size)), f"part {r}"
    if parts == 2 or quantized.format.name not in ("lut3", "lut4"):  # 4 x 128 rows: 4 tables, room for 2
        assert torch.equal(cat(pieces, dim, "w").dequantize(), whole)


def test_gate_up_halves_split_alike(quantized):
    """w13 [E, 2I, D]: rank r keeps rows r of the gate half and r of the up half."""
    spec = ShardSpec(quantized.shape, Split(1, 1, 2, halves=True), experts=(1, 1))
    if quantized.format.name.startswith("lut"):  # 128 gate + 128 up rows would need 2 tables of 256 rows
        with pytest.raises(LowbitError, match=r"cannot join the pieces of 'experts.w13'"):
            take(quantized, spec, "experts.w13")
        return
    got = take(quantized, spec, "experts.w13")
    whole = quantized.dequantize()
    half, part = N // 2, N // 4
    want = torch.cat([whole[1:2, part:2 * part], whole[1:2, half + part:half + 2 * part]], dim=1)
    assert got.shape == spec.local and torch.equal(got.dequantize(), want)
    gate_piece = take_piece(narrow(quantized[1], 0, 0, half, "g"), spec, 0, "g")  # [I, D] of expert 1
    assert torch.equal(gate_piece.dequantize(), whole[1, part:2 * part])


@pytest.mark.parametrize("name,dim,at", [("nvfp4", -1, 24), ("int4", -1, 64), ("fp8-block", -2, 64),
                                         ("mxfp4", -1, 48), ("int4", -1, 96)])
def test_cut_inside_a_block_is_refused(weight, name, dim, at):
    qt = FORMATS[name].quantize(weight)
    with pytest.raises(LowbitError, match=r"cannot shard 'layers\.0\.w': .* inside a block .* multiple of the block"):
        narrow(qt, dim, at, at, "layers.0.w")


def test_dense_vocab_pads_and_bias_zeroes():
    w = torch.arange(10.0).reshape(5, 2)
    spec = ShardSpec((5, 2), Split(0, 1, 2, padded=6))
    assert spec.local == (3, 2)
    assert torch.equal(take(w, spec, "embed"), torch.tensor([[6.0, 7.0], [8.0, 9.0], [0.0, 0.0]]))
    assert torch.equal(take(torch.ones(4), ShardSpec((4,), zero=True), "o_proj.bias"), torch.zeros(4))
    with pytest.raises(LowbitError, match=r"'embed' has shape \[4, 2\] .* expects \[5, 2\]"):
        take(w[:4], spec, "embed")


def test_uneven_dense_split_is_refused():
    with pytest.raises(LowbitError, match=r"cannot split 'q_proj.weight' \(shape \[6, 4\]\) into 4 equal parts"):
        take(torch.zeros(6, 4), ShardSpec((6, 4), Split(0, 0, 4)), "q_proj.weight")
