import math

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.formats import FORMATS, SCALAR_FORMATS, QuantizedTensor, get_format, lut_view_decode

SHAPE = (4096, 4096)
# Exact storage per weight of a 4096 x 4096 matrix (docs/FORMATS.md, "Bits per weight").
BPW_4096 = {
    "fp8": 8 + 32 / 4096,
    "fp8-block": 8 + 32 / (128 * 128),
    "nvfp4": 4 + 8 / 16 + 32 / 4096**2,
    "mxfp4": 4 + 8 / 32,
    "mxfp8": 8 + 8 / 32,
    "nf4": 4 + 16 / 64,
    "nf3": 3 + 16 / 64,
    "int4": 4 + 16 / 128 + 8 / 128,
    "int4-g64": 4 + 16 / 64 + 8 / 64,
    "int4-g32": 4 + 16 / 32 + 8 / 32,
    "lut4": 4 + 16 / 64 + (16 * 16 * 32 + 4096 * 32) / 4096**2,
    "lut3": 3 + 16 / 64 + (16 * 8 * 32 + 4096 * 32) / 4096**2,
    "vq2": 2 + 16 / 64,
    "vq3": 3 + 16 / 64,
    "vq4": 4 + 16 / 64,
}


def gaussian(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_registry_knows_every_format_and_refuses_unknown_names():
    assert set(BPW_4096) == set(FORMATS)
    with pytest.raises(LowbitError, match="nvfp4"):
        get_format("fp5")


@pytest.mark.parametrize("name", sorted(BPW_4096))
def test_bits_per_weight_is_exact(name):
    fmt = get_format(name)
    assert fmt.bits_per_weight(SHAPE) == BPW_4096[name]
    assert set(fmt.payload_names) == set(fmt.payload_spec(SHAPE))


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("shape", [(3, 17), (2, 17, 200)])
def test_bits_per_weight_counts_every_payload_byte(name, shape):
    qt = get_format(name).quantize(gaussian(*shape))
    assert qt.nbytes * 8 == get_format(name).payload_bits(shape)
    assert qt.bits_per_weight == get_format(name).bits_per_weight(shape)


@pytest.mark.parametrize("name", SCALAR_FORMATS)
@pytest.mark.parametrize("shape", [(3, 64), (17, 64), (3, 17), (17, 200), (3, 256), (2, 3, 100)])
def test_lut_view_decode_equals_decode(name, shape):
    fmt = get_format(name)
    payload = fmt.encode(gaussian(*shape, seed=shape[-1]) * 0.02)
    view = fmt.lut_view(payload)
    assert view.codes.data_ptr() == payload["codes"].data_ptr()  # zero-copy
    assert view.scales.data_ptr() == payload["scales"].data_ptr()
    assert view.table.dtype == torch.float32 and view.table.shape[-1] == 1 << view.bits
    nb = math.ceil(shape[-1] / view.block_size)
    assert view.scales.shape == (*shape[:-1], nb)
    assert view.codes.shape == (*shape[:-1], nb * view.block_size * view.bits // 8)
    if view.table_index is not None:
        assert view.table_index.dtype == torch.int32 and view.table_index.shape == shape[:-1]
    got = lut_view_decode(view)
    assert torch.equal(got[..., : shape[-1]], fmt.decode(payload, shape))
    assert not got[..., shape[-1] :].isnan().any()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_expert_index_gives_the_expert_alone(name):
    w = gaussian(3, 5, 40)
    qt = get_format(name).quantize(w)
    for e in range(3):
        alone = get_format(name).quantize(w[e]).dequantize()  # per-expert scales and tables
        assert qt[e].shape == (5, 40)
        assert torch.equal(qt[e].dequantize(), alone)
    assert qt[1:].shape == (2, 5, 40)
    assert torch.equal(qt[-1].dequantize(), qt.dequantize()[2])


def test_quantized_tensor_basics():
    qt = get_format("nf4").quantize(gaussian(4, 64))
    assert qt.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert qt.to("cpu").device.type == "cpu"
    assert qt.nbytes == 4 * 32 + 4 * 2
    assert "nf4" in repr(qt)
    with pytest.raises(LowbitError, match="stacked"):
        qt[0]
    stacked = get_format("nf4").quantize(gaussian(2, 4, 64))
    with pytest.raises(LowbitError, match="out of range"):
        stacked[2]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_bad_inputs_are_refused_with_a_reason(name):
    fmt = get_format(name)
    with pytest.raises(LowbitError, match="float32, bfloat16 or float16"):
        fmt.encode(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(LowbitError, match=r"\[\.\.\., N, K\]"):
        fmt.encode(torch.zeros(8))
    with pytest.raises(LowbitError, match=r"\[\.\.\., N, K\]"):
        fmt.encode(torch.zeros(0, 8))
    w = torch.zeros(2, 3, 8)
    w[1, 2, 5] = float("nan")
    with pytest.raises(LowbitError, match=r"\[1, 2, 5\]"):
        fmt.encode(w)


def test_payload_mismatch_is_refused():
    fmt = get_format("nvfp4")
    payload = fmt.encode(gaussian(2, 32))
    with pytest.raises(LowbitError, match="needs"):
        fmt.decode(payload, (2, 48))
    del payload["global_scale"]
    with pytest.raises(LowbitError, match="global_scale"):
        QuantizedTensor(fmt, (2, 32), payload)


@pytest.mark.parametrize("name", ["fp8", "fp8-block", "mxfp8"])
def test_eight_bit_formats_have_no_lut_view(name):
    fmt = get_format(name)
    with pytest.raises(LowbitError, match="no LUT view"):
        fmt.lut_view(fmt.encode(gaussian(2, 32)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_encode_like_their_float32_values(dtype):
    w = gaussian(3, 96).to(dtype)
    for name in FORMATS:
        a, b = get_format(name).encode(w), get_format(name).encode(w.float())
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_a_format_that_refuses_k_names_the_shape_and_block():
    class Strict(type(get_format("nf4"))):
        pads_k = False

    strict = Strict("nf4-strict", 4, (0.0,) * 16)
    with pytest.raises(LowbitError, match=r"multiple of its block 64.*\[3, 100\]"):
        strict.encode(gaussian(3, 100))
    with pytest.raises(LowbitError, match="block 64"):
        strict.bits_per_weight((3, 100))
    assert strict.bits_per_weight((3, 128)) == 4.25


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_cuda_encodes_the_same_bytes_as_the_cpu(name):
    w = gaussian(3, 129, 200) * torch.logspace(-3, 3, 200)
    fmt = get_format(name)
    cpu = fmt.encode(w)
    kw = {"table": cpu["table"].cuda()} if "table" in cpu else {}  # the fit itself may differ
    gpu = fmt.encode(w.cuda(), **kw)
    for key, t in cpu.items():
        assert torch.equal(
            t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
            (gpu[key].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else gpu[key]).cpu(),
        ), key
