"""The vector codebook GEMV (lowbit/kernels/vq_gemv.py) against its torch twin, in the
Triton interpreter, on fresh random payloads between NaN guards, and through the linear door."""

from __future__ import annotations

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.formats import get_format
from lowbit.formats.views import VqWeight
from lowbit.formats.vq import pack_codebook
from lowbit.kernels import routes
from lowbit.kernels.linear_op import linear
from lowbit.kernels.vq_gemv import blocks_split_plan, reference_vq_linear, vq_gemv
from lowbit.kernels.weights import resolve
from tests.kernels.cases import compile_offline, guarded, rel_err

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small ops: one thread (conftest)


GEOMETRIES = {"d4_ib8": (4, 8), "d4_ib12": (4, 12), "d2_ib8": (2, 8)}


def random_vq(n: int, k: int, dim: int, bits: int, seed: int, lead: tuple[int, ...] = (),
              packed: bool = False) -> VqWeight:
    """Random indices, bf16 scales and float32 codebook, each between poisoned guards; with
    `packed`, a float16-valued codebook and its packed words (the shipped codebooks' case)."""
    g = torch.Generator().manual_seed(seed)
    kp = -(-k // 64) * 64
    groups = kp // dim
    codes = torch.randint(0, 256, (*lead, n, groups * bits // 8), generator=g, dtype=torch.uint8)
    scales = (torch.rand(*lead, n, kp // 64, generator=g) + 0.1).to(torch.bfloat16)
    book = torch.randn(1 << bits, dim, generator=g)
    if packed:
        book = book.half().float()
        return VqWeight(guarded(codes), guarded(scales), guarded(book), bits, "random", guarded(pack_codebook(book)))
    return VqWeight(guarded(codes), guarded(scales), guarded(book), bits, "random")


@pytest.mark.parametrize("geo", list(GEOMETRIES))
@pytest.mark.parametrize("m,n,k", [(1, 17, 64), (3, 33, 100), (4, 70, 200), (16, 9, 130)])
def test_gemv_matches_twin(geo, m, n, k):
    dim, bits = GEOMETRIES[geo]
    w = random_vq(n, k, dim, bits, seed=m * 1000 + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    bias = guarded(torch.randn(n)) if m % 2 else None
    out = torch.full((m, n), float("nan"))
    y = vq_gemv(x, w, bias, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert rel_err(y, reference_vq_linear(x, w, bias)) < 1e-5


@pytest.mark.parametrize("geo", list(GEOMETRIES))
@pytest.mark.parametrize("m,n,k,cfg", [
    (1, 17, 64, {"BN": 16}),  # one block: BB 4 steps past NB, masked
    (2, 33, 100, {"BN": 16, "BB": 1, "SPLIT_K": 2}),  # K < Kp, split in two
    (5, 70, 200, {"BN": 16, "BB": 2, "SPLIT_K": 3}),  # M tail of a BM 4 program, 4 blocks in 2 splits
    (16, 9, 130, {"BN": 16, "BB": 1, "SPLIT_K": 3}),  # 3 blocks, one a split
    (4, 64, 256, {"BN": 32, "BB": 2, "SPLIT_K": 2}),  # EVEN: no masks, two splits
    (1, 32, 512, {"BN": 16, "BB": 4}),  # EVEN at BM 1, the default split count
])
def test_packed_gemv_matches_twin_and_the_float32_gathers(geo, m, n, k, cfg):
    """The packed block kernel (split-K, masked and EVEN forms) against the twin and the
    float32-gather kernel."""
    dim, bits = GEOMETRIES[geo]
    w = random_vq(n, k, dim, bits, seed=m * 1000 + n + k + 7, packed=True)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + 1))
    bias = guarded(torch.randn(n)) if m % 2 else None
    y = vq_gemv(x, w, bias, out=torch.full((m, n), float("nan")), config=cfg)
    assert rel_err(y, reference_vq_linear(x, w, bias)) < 1e-5
    unpacked = vq_gemv(x, w, bias, config={"BN": 16, "BG": 8, "PACKED": False})
    assert rel_err(y, unpacked) < 1e-6


def test_blocks_split_plan_covers_k_in_whole_steps():
    for nb, bb, split, tiles in ((32, 4, 0, 4), (3, 1, 3, 1), (4, 2, 3, 2), (1, 4, 8, 1), (224, 4, 0, 448)):
        got, bps = blocks_split_plan({"BB": bb, "SPLIT_K": split}, nb, tiles)
        assert bps % bb == 0 and 1 <= got <= max(1, split or 8)
        assert (got - 1) * bps < nb <= got * bps  # every split has blocks, together all of them


_STATIC = """
import json, sys
sys.path.insert(0, "scripts")
import torch
from tune_kernels import compile_static
from lowbit.formats import get_format
from lowbit.kernels import vq_gemv as V
from lowbit.kernels.weights import resolve
out = {}
for fmt in ("vq2", "vq3", "vq4"):
    w = resolve(get_format(fmt).quantize(torch.randn(64, 256)))
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    y = torch.empty(1, 64, dtype=torch.bfloat16)
    ws, sem = torch.empty(1), torch.zeros(4, dtype=torch.int32)
    args = (x, y, x, ws, sem, w.codes, w.scales.view(torch.int16), w.packed, 1, 4096, 4096, 64, 16, 4,
            4096, 4096, 4096, 64)
    kw = dict(D=w.dim, IB=w.index_bits, HAS_BIAS=False, BM=1, BN=32, BB=4, EVEN=True, SPLIT=True,
              num_warps=4)
    st = compile_static(V._vq_gemv_blocks_kernel, args, kw, 90)
    out[fmt] = {"local": st["local"], "regs": st["regs"], "per_weight": st["loop"] * 32 * 4 / (32 * 4 * 64),
                "shfl": st["ops"].get("SHFL", 0)}
print(json.dumps(out))
"""


def test_packed_kernel_main_loop_for_sm90():
    """Offline sm_90 compile (no GPU) of the default M = 1 config: no spills, no warp shuffle
    in the K loop (the sum over groups waits for the end), and at most 7 lane instructions a
    weight in it (5.2 / 6.6 / 6.6 when written; the first packed form took 25-30)."""
    stats = compile_offline(_STATIC)
    for fmt, st in stats.items():
        assert st["local"] == "0" and st["regs"] <= 255, (fmt, st)
        assert st["shfl"] == 0 and st["per_weight"] <= 7.0, (fmt, st)


def test_pack_codebook_lanes_and_refusal():
    book = torch.tensor([[1.0, -2.0, 0.5, 65504.0], [0.0, -0.0, 3.0, -1.0]])
    words = pack_codebook(book)
    assert words.dtype == torch.int64 and words.shape == (2,)
    assert int(words[0]) & 0xFFFF == 0x3C00 and (int(words[0]) >> 16) & 0xFFFF == 0xC000  # 1.0, -2.0
    assert (int(words[0]) >> 48) & 0xFFFF == 0x7BFF and (int(words[1]) >> 16) & 0xFFFF == 0x8000
    assert pack_codebook(book + 1e-4) is None  # not float16 values: no packing
    assert pack_codebook(torch.zeros(4, 8)) is None  # more than 4 lanes
    qt = get_format("vq3").quantize(torch.randn(8, 64))
    assert resolve(qt).packed is not None  # the shipped codebooks pack


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_half_activations(dtype):
    w = random_vq(40, 96, 4, 12, seed=3)
    x = torch.randn(2, 96).to(dtype)
    y = vq_gemv(x, w, None, config={"BN": 16, "BG": 16})
    assert y.dtype == dtype
    assert rel_err(y, reference_vq_linear(x, w)) < 1e-2


def test_gemv_refuses_bad_calls():
    w = random_vq(8, 64, 4, 8, seed=1)
    with pytest.raises(ValueError, match="M <= 16"):
        vq_gemv(torch.randn(17, 64), w)
    with pytest.raises(ValueError, match="columns"):
        vq_gemv(torch.randn(1, 65), w)
    with pytest.raises(ValueError, match="bias"):
        vq_gemv(torch.randn(1, 64), w, torch.randn(9))
    with pytest.raises(ValueError, match="stacked"):
        vq_gemv(torch.randn(1, 64), random_vq(8, 64, 4, 8, seed=1, lead=(2,)))


def test_linear_door_routes_vq_weights(monkeypatch):
    fmt = get_format("vq2")
    wt = torch.randn(24, 72, generator=torch.Generator().manual_seed(5))
    qt = fmt.quantize(wt)
    assert isinstance(resolve(qt), VqWeight)
    x = torch.randn(3, 72)
    monkeypatch.delenv("LOWBIT_ROUTE_LINEAR", raising=False)
    ref = linear(x, qt)  # CPU, unforced: the torch route
    assert rel_err(ref, x @ qt.dequantize().t()) < 1e-6
    routes.reset_counters()
    monkeypatch.setenv("LOWBIT_ROUTE_LINEAR", "triton_vq_gemv")
    y = linear(x, qt, layer="t")
    assert rel_err(y, ref) < 1e-5
    assert any(r["route"] == "triton_vq_gemv" and r["calls"] == 1 for r in routes.route_table())
    with pytest.raises(LowbitError, match="M <= 16"):
        linear(torch.randn(17, 72), qt)
    with pytest.raises(LowbitError, match="this route reads VqWeight"):
        linear(x, get_format("nf4").quantize(wt))


def test_moe_kernels_refuse_vq_experts():
    """No fused MoE kernel reads vector-codebook experts: the admission says so, and the
    registry's reference route serves them (with the CUDA warning) instead of crashing."""
    from lowbit.kernels.moe import moe_refusal

    w13, w2 = random_vq(16, 32, 4, 8, seed=1, lead=(3,)), random_vq(32, 8, 4, 8, seed=2, lead=(3,))
    reason = moe_refusal(torch.randn(2, 32), w13, w2)
    assert reason is not None and "VqWeight: no fused MoE kernel reads it" in reason
