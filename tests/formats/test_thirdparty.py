"""Third-party layouts built by hand from their public descriptions (not with our
encoders), then read and checked against a plain float reference."""

import math

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.formats.thirdparty import (
    from_awq,
    from_compressed_tensors_nvfp4,
    from_deepseek_fp8,
    from_gpt_oss_mxfp4,
    from_gptq,
)

FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def ints(shape, high, seed, low=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).tolist()


def int32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def test_deepseek_fp8_block_scales():
    n, k = 130, 200
    w8 = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).to(torch.float8_e4m3fn)
    inv = torch.rand(2, 2, generator=torch.Generator().manual_seed(1)) + 0.1
    qt = from_deepseek_fp8(w8, inv)
    rows, cols = torch.arange(n) // 128, torch.arange(k) // 128
    ref = w8.float() * inv[rows[:, None], cols[None, :]]
    assert qt.format.name == "fp8-block" and qt.shape == (n, k)
    assert torch.equal(qt.dequantize(), ref)
    with pytest.raises(LowbitError, match="weight_scale_inv"):
        from_deepseek_fp8(w8, inv[:1])


def test_gpt_oss_mxfp4_blocks():
    e, n, k = 2, 3, 64
    codes = ints((e, n, k), 16, 2)
    exps = ints((e, n, k // 32), 135, 3, low=118)
    blocks = torch.zeros(e, n, k // 32, 16, dtype=torch.uint8)
    ref = torch.zeros(e, n, k)
    for a in range(e):
        for b in range(n):
            for kk in range(k):
                g, j = divmod(kk, 32)
                blocks[a, b, g, j // 2] |= codes[a][b][kk] << (4 * (j % 2))
                ref[a, b, kk] = math.ldexp(FP4[codes[a][b][kk]], exps[a][b][g] - 127)
    scales = torch.tensor(exps, dtype=torch.uint8)
    qt = from_gpt_oss_mxfp4(blocks, scales)
    assert qt.format.name == "mxfp4" and qt.shape == (e, n, k)
    assert qt.payload["codes"].data_ptr() == blocks.data_ptr()  # zero-copy
    assert torch.equal(qt.dequantize(), ref)
    assert torch.equal(qt[1].dequantize(), ref[1])
    with pytest.raises(LowbitError, match="scales"):
        from_gpt_oss_mxfp4(blocks, scales[..., :1])


@pytest.mark.parametrize("global_ct", [2.0, 2688 / 3.3])
def test_compressed_tensors_nvfp4(global_ct):
    n, k = 4, 32
    codes = ints((n, k), 16, 4)
    packed = torch.zeros(n, k // 2, dtype=torch.uint8)
    for i in range(n):
        for j in range(k):
            packed[i, j // 2] |= codes[i][j] << (4 * (j % 2))
    scale = torch.rand(n, k // 16, generator=torch.Generator().manual_seed(5)) * 400
    scale = scale.to(torch.float8_e4m3fn)
    gs = torch.tensor([global_ct], dtype=torch.float32)
    ref = torch.tensor(
        [
            [FP4[codes[i][j]] * float(scale[i, j // 16].float() / gs) for j in range(k)]
            for i in range(n)
        ]
    )
    qt = from_compressed_tensors_nvfp4(packed, scale, gs)
    assert qt.format.name == "nvfp4" and qt.shape == (n, k)
    got = qt.dequantize()
    if global_ct == 2.0:  # 1 / 2 is exact: bit-identical
        assert torch.equal(got, ref)
    assert torch.allclose(got, ref, rtol=3e-7, atol=0)


def awq_pack(cols: list[list[int]]) -> torch.Tensor:
    """[R][N] nibbles -> int32 [R, N/8] in AWQ's interleaved order."""
    rows = len(cols)
    out = [[0] * (len(cols[0]) // 8) for _ in range(rows)]
    for r in range(rows):
        for c in range(len(out[0])):
            v = 0
            for i in range(8):
                v |= cols[r][8 * c + AWQ_PACK_ORDER[i]] << (4 * i)
            out[r][c] = int32(v)
    return torch.tensor(out, dtype=torch.int32)


def int4_reference(q, z, s, group):
    k, n = len(q), len(q[0])
    return torch.tensor(
        [
            [(q[kk][nn] - z[kk // group][nn]) * float(s[kk // group, nn]) for kk in range(k)]
            for nn in range(n)
        ]
    )


@pytest.mark.parametrize("group,name", [(128, "int4"), (64, "int4-g64")])
def test_awq_gemm_layout(group, name):
    k, n = 256, 16
    q = ints((k, n), 16, 6)
    z = ints((k // group, n), 16, 7)
    s = (torch.rand(k // group, n, generator=torch.Generator().manual_seed(8)) * 0.1).half()
    qt = from_awq(awq_pack(q), awq_pack(z), s)
    assert qt.format.name == name and qt.shape == (n, k)
    assert torch.equal(qt.dequantize(), int4_reference(q, z, s, group))


def test_awq_unsupported_group_is_refused():
    q = [[0] * 8 for _ in range(32)]
    with pytest.raises(LowbitError, match="group size 16"):
        from_awq(awq_pack(q), awq_pack(q[:2]), torch.ones(2, 8).half())


def gptq_pack_rows(q: list[list[int]]) -> torch.Tensor:
    """[K][N] -> int32 [K/8, N]: nibble i of row r is k = 8r + i."""
    k, n = len(q), len(q[0])
    return torch.tensor(
        [
            [int32(sum(q[8 * r + i][c] << (4 * i) for i in range(8))) for c in range(n)]
            for r in range(k // 8)
        ],
        dtype=torch.int32,
    )


def gptq_pack_cols(z: list[list[int]]) -> torch.Tensor:
    """[G][N] -> int32 [G, N/8]: nibble i of column c is n = 8c + i."""
    return torch.tensor(
        [
            [int32(sum(row[8 * c + i] << (4 * i) for i in range(8))) for c in range(len(row) // 8)]
            for row in z
        ],
        dtype=torch.int32,
    )


@pytest.mark.parametrize("zero_offset", [1, 0])
def test_gptq_layout_and_zero_offset(zero_offset):
    k, n, group = 256, 16, 128
    q = ints((k, n), 16, 9)
    z = ints((k // group, n), 16, 10, low=1)
    stored = [[v - zero_offset for v in row] for row in z]
    s = (torch.rand(k // group, n, generator=torch.Generator().manual_seed(11)) * 0.1).half()
    g_idx = torch.arange(k, dtype=torch.int32) // group
    qt = from_gptq(gptq_pack_rows(q), gptq_pack_cols(stored), s, g_idx, zero_offset=zero_offset)
    assert qt.format.name == "int4" and qt.shape == (n, k)
    assert torch.equal(qt.dequantize(), int4_reference(q, z, s, group))


def test_gptq_act_order_is_refused():
    k, n = 128, 8
    q = [[1] * n for _ in range(k)]
    g_idx = torch.zeros(k, dtype=torch.int32)
    g_idx[:64] = 1
    s = torch.ones(2, n).half()
    with pytest.raises(LowbitError, match="act-order"):
        from_gptq(gptq_pack_rows(q), gptq_pack_cols([[1] * n, [1] * n]), s, g_idx)
