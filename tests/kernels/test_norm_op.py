"""The `norm` op: the Triton route against the torch route (forced through the registry, on the
Triton interpreter), the torch route against the HF RMSNorm expression, and the refusals.

Inputs sit between NaN guards (a read past a row's end shows). The kernel reproduces every
rounding of the torch expression, so outputs are equal except where the fp32 sum of squares,
summed in another order, moves a value across a rounding boundary, on a small fraction of the
elements (the output then moves by one or two units in the last place).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.errors import LowbitError  # noqa: E402
from lowbit.kernels import norm_op, routes  # noqa: E402
from lowbit.kernels.runtime import interpreting, tl, triton  # noqa: E402
from tests.kernels.cases import guarded  # noqa: E402

EPS = 1e-6
TRITON = "triton_rmsnorm"

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The HF reference models' RMSNorm, spelled out (the semantics the op must keep)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def assert_ulp_close(got: torch.Tensor, want: torch.Tensor, max_frac: float = 2e-3) -> None:
    """Same dtype and shape, finite, unequal on at most max_frac of the elements, and there at
    most two units in the last place apart (a flipped rounding of the normed value, times the
    weight, can cross an exponent)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all(), "non-finite output (unwritten or NaN)"
    diff = (got.float() - want.float()).abs()
    ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp(min=1e-30)
    assert (diff <= 2 * ulp).all(), f"off by more than two ulps: max diff {diff.max().item()}"
    assert (got != want).float().mean().item() <= max_frac


def _data(T: int, D: int, dtype: torch.dtype, residual: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = guarded((torch.randn(T, D, generator=g) * 3).to(dtype))
    res = guarded(torch.randn(T, D, generator=g).to(dtype)) if residual else None
    w = guarded((1 + 0.2 * torch.randn(D, generator=g)).to(dtype))
    return x, w, res


def _both_routes(monkeypatch, x, w, res, layer="test"):
    monkeypatch.setenv("LOWBIT_ROUTE_NORM", TRITON)
    got = norm_op.rms_norm(x, w, EPS, res, layer=layer)
    monkeypatch.setenv("LOWBIT_ROUTE_NORM", "torch")
    want = norm_op.rms_norm(x, w, EPS, res, layer=layer)
    return got, want


@pytest.mark.parametrize("D", [64, 200, 2048])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_matches_torch(monkeypatch, dtype, residual, D):
    routes.reset_counters()
    for T in (1, 3, 17):
        x, w, res = _data(T, D, dtype, residual, seed=T * D)
        (y, r), (y_ref, r_ref) = _both_routes(monkeypatch, x, w, res)
        if dtype == torch.float32:
            torch.testing.assert_close(y, y_ref, rtol=3e-6, atol=1e-6)
        else:
            assert_ulp_close(y, y_ref)
        assert torch.equal(r, r_ref)  # the rounded sum is exact in both routes
        if not residual:
            assert r is x  # no residual: r is x itself, nothing written
    calls = {(c["layer"], c["route"]): c["count"] for c in routes.counters()["route_calls"]
             if c["op"] == "norm"}
    assert calls == {("test", TRITON): 3, ("test", "torch"): 3}


def test_bf16_is_bit_exact_on_small_rows(monkeypatch):
    """Row sums of 64 values come out the same in both orders here: every bit must agree,
    which checks the round-to-nearest-even of bf16 (the interpreter's cast truncates)."""
    x, w, res = _data(17, 64, torch.bfloat16, True, seed=5)
    (y, r), (y_ref, r_ref) = _both_routes(monkeypatch, x, w, res)
    assert torch.equal(y, y_ref) and torch.equal(r, r_ref)


def test_per_head_rows_and_float32_weight(monkeypatch):
    """x [T, H, Dh] normed per head (qk-norm), rows 64 apart (a slice of wider heads), weight
    float32: y is float32 as torch promotes."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 64, generator=g).bfloat16()[:, :, :48]
    w = 1 + 0.2 * torch.randn(48, generator=g)
    (y, r), (y_ref, _) = _both_routes(monkeypatch, x, w, None)
    assert y.dtype == torch.float32 and y.shape == x.shape and r is x
    torch.testing.assert_close(y, y_ref, rtol=3e-6, atol=1e-6)


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, DT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, norm_op.round_to(x, DT), mask=offs < n)


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = torch.empty_like(x)
    _round_kernel[(1,)](x, y, x.numel(), DT=norm_op.DTYPE_CODE[dtype], BLOCK=128)
    return y


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # numpy, for the fp16 inf
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_to_is_torch_cast(dtype):
    """round_to equals torch's float32 -> dtype cast: random values, ties to even, overflow to
    inf, and NaNs of any payload (0x7FFFFFFF is the GPU's; it must not carry into the sign)."""
    g = torch.Generator().manual_seed(0)
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FFFFFFF,
                         0x7FC00000, 0xFFFFFFFF, 0x00000001, 0x80000000], dtype=torch.int64)
    x = torch.cat((bits.to(torch.int32).view(torch.float32), torch.randn(54, generator=g) * 1e3))
    y, want = _round(x, dtype), x.to(dtype).float()
    assert torch.isnan(y[5:8]).all()
    y[5:8] = want[5:8] = 0.0
    assert torch.equal(y.view(torch.int32), want.view(torch.int32))  # signs of zeros too


def test_round_to_e4m3_is_torch_cast():
    """The KV-cache code rounding: normal and subnormal e4m3 values, ties both ways, and the
    largest value 448 (the codes of x / (amax / 448) never pass it)."""
    g = torch.Generator().manual_seed(1)
    ties = torch.tensor([1.0625, 1.1875, 2.0 ** -9 * 1.5, 2.0 ** -9 * 2.5, 2.0 ** -6 * 0.99, 448.0,
                         -1.0625, -(2.0 ** -9) * 0.5, 0.0, 460.0, 300.0, -2.0 ** -7 * 1.0625])
    x = torch.cat((ties, torch.randn(60, generator=g) * 100, torch.randn(56, generator=g) / 64))
    got, want = _round(x, torch.float8_e4m3fn), x.to(torch.float8_e4m3fn).float()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0 stays -0


def test_nan_rows_stay_nan(monkeypatch):
    """A NaN input row gives a NaN output row (the bf16 rounding on bits must not turn NaN into
    a number); the other rows are unaffected."""
    x, w, _ = _data(3, 64, torch.bfloat16, False, seed=2)
    x[1, 7] = float("nan")
    (y, _), (y_ref, _) = _both_routes(monkeypatch, x, w, None)
    assert torch.isnan(y[1]).all() and torch.isnan(y_ref[1]).all()
    assert torch.equal(y[[0, 2]], y_ref[[0, 2]])


def test_torch_route_is_the_hf_expression():
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(5, 96, generator=g).to(dtype)
        res = torch.randn(5, 96, generator=g).to(dtype)
        w = (1 + 0.2 * torch.randn(96, generator=g)).to(dtype)
        y, r = norm_op._run_torch(norm_op.NormCall(x, w, EPS, res))
        assert torch.equal(r, x + res)
        assert torch.equal(y, hf_rms_norm(x + res, w, EPS))
        y, r = norm_op._run_torch(norm_op.NormCall(x, w, EPS))
        assert r is x and torch.equal(y, hf_rms_norm(x, w, EPS))


def _refusal(x, w, res=None, forced=True) -> str | None:
    return norm_op._admit_triton(norm_op.NormCall(x, w, EPS, res, forced=forced))


def test_refusals():
    x, w = torch.randn(4, 64).bfloat16(), torch.ones(64).bfloat16()
    assert _refusal(x, w) is None
    assert "float64" in _refusal(x.double(), w)
    assert "> 16384" in _refusal(torch.randn(2, 16400).bfloat16(), torch.ones(16400).bfloat16())
    assert "not contiguous" in _refusal(torch.randn(64, 4).bfloat16().t(), w)
    assert "not contiguous" in _refusal(torch.randn(4, 5, 64).bfloat16()[:, :3], w)
    assert "residual is torch.float32" in _refusal(x, w, torch.randn(4, 64))
    assert "weight (32,)" in _refusal(x, torch.ones(32).bfloat16())
    assert "TRITON_INTERPRET=1 and a forced route" in _refusal(x, w, forced=False)


def test_auto_on_cpu_runs_torch_and_forced_refusal_raises(monkeypatch):
    monkeypatch.delenv("LOWBIT_ROUTE_NORM", raising=False)
    routes.reset_counters()
    x, w = torch.randn(2, 64), torch.ones(64)
    y, _ = norm_op.rms_norm(x, w, EPS, layer="L0")
    assert torch.equal(y, hf_rms_norm(x, w, EPS))
    assert [(c["route"], c["count"]) for c in routes.counters()["route_calls"]] == [("torch", 1)]
    refused = routes.counters()["route_refusals"]
    assert [(c["route"], c["layer"]) for c in refused] == [(TRITON, "L0")]
    monkeypatch.setenv("LOWBIT_ROUTE_NORM", TRITON)
    with pytest.raises(LowbitError, match="float64"):
        norm_op.rms_norm(x.double(), w.double(), EPS)


@pytest.mark.parametrize("residual,extra", [(False, False), (True, False), (True, True)])
def test_slot_sum_is_the_combine_launch_then_the_norm(monkeypatch, residual, extra):
    """A fused MoE's unsummed slot rows (moe_slots.SlotSum) go into the norm: the Triton
    route sums each token's named slots in order in its own launch, and its (y, r) equal the
    combine launch followed by the norm bit for bit; a slot placed nowhere (id outside
    0..E-1, its row NaN) is never read; without a residual r is the slot sum, written into
    the SlotSum's out. An extra (shared experts' output) is added to the rounded sum and
    rounded again, as the op adds it. The torch route sums with the twin and agrees to the
    norm's ulps.
    (The twin stands for the combine launch in bf16: the interpreter truncates the launch's
    bf16 store, where the GPU rounds, as the twin does; in float32 the two are equal.)"""
    from lowbit.kernels.moe_slots import SlotSum, combine_slots, reference_slot_sum

    t, a, e, d = 7, 3, 9, 300
    g = torch.Generator().manual_seed(11)
    ys = guarded(torch.randn(t * a, d, generator=g) * 2)
    ids = torch.randint(0, e, (t * a,), generator=g).to(torch.int32)
    ids[4], ids[10] = e, -1
    ys[4], ys[10] = float("nan"), float("nan")
    _, w, res = _data(t, d, torch.bfloat16, residual, seed=12)

    shared = guarded(torch.randn(t, d, generator=g).bfloat16()) if extra else None

    def slots():
        return SlotSum(ys, ids, a, e, guarded(torch.full((t, d), float("nan")).bfloat16()), shared)

    monkeypatch.setenv("LOWBIT_ROUTE_NORM", TRITON)
    routes.reset_counters()
    f32 = SlotSum(ys, ids, a, e, torch.empty(t, d))
    assert torch.equal(combine_slots(ys, torch.empty(t, d), a, ids, e), reference_slot_sum(f32))
    summed = reference_slot_sum(slots())
    if extra:
        assert torch.equal(summed, reference_slot_sum(SlotSum(ys, ids, a, e, torch.empty(t, d).bfloat16())) + shared)
    want_y, want_r = norm_op.rms_norm(summed, w, EPS, res)
    s = slots()
    got_y, got_r = norm_op.rms_norm(s, w, EPS, res)
    assert torch.equal(got_y, want_y) and torch.equal(got_r, want_r)
    if not residual:
        assert got_r is s.out and torch.equal(s.out, summed)
    monkeypatch.setenv("LOWBIT_ROUTE_NORM", "torch")
    ref_y, ref_r = norm_op.rms_norm(slots(), w, EPS, res)
    assert torch.equal(ref_r, want_r)
    assert_ulp_close(got_y, ref_y, max_frac=2e-2)
    calls = {c["route"]: c["count"] for c in routes.counters()["route_calls"] if c["op"] == "norm"}
    assert calls == {TRITON: 2, "torch": 1}, calls
