"""The `rope` op (q/k RMSNorm + RoPE + KV write): the Triton route against the torch route
(forced through the registry, on the Triton interpreter), the torch route against the model
layers' RotaryEmbedding / apply_rope and the HF RMSNorm expression, and the refusals.

qkv sits between NaN guards (a read past its ends shows). Both routes write NaN-poisoned pools
at shuffled rows: written rows must hold the returned k and v, the rest stay NaN. Without
qk-norm the kernel's float32 math is the torch route's op for op, so bf16 results are equal;
with it, the sum of squares is summed in another order (see test_norm_op).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.errors import LowbitError  # noqa: E402
from lowbit.kernels import routes  # noqa: E402
from lowbit.kernels.attention import FP8, KVPool, reference_kv_write  # noqa: E402
from lowbit.kernels.rope_op import (  # noqa: E402
    RopeCall,
    _admit_triton,
    _run_torch,
    qk_norm_rope,
    rope_cos_sin,
)
from lowbit.kernels.runtime import interpreting  # noqa: E402
from lowbit.layers.rope import RotaryEmbedding, apply_rope  # noqa: E402
from tests.kernels.cases import guarded, poisoned  # noqa: E402
from tests.kernels.test_norm_op import assert_ulp_close, hf_rms_norm  # noqa: E402

EPS = 1e-6
P = 48  # table positions
ROWS = 40  # pool rows
TRITON = "triton_qk_norm_rope"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")


def make_call(T: int, heads: tuple[int, int, int], dtype=torch.bfloat16, norm: bool = True,
              pool: bool = True, seed: int = 0, kv_dtype=None) -> RopeCall:
    H, Hkv, Dh = heads
    g = torch.Generator().manual_seed(seed)
    qkv = guarded((torch.randn(T, (H + 2 * Hkv) * Dh, generator=g) * 2).to(dtype))
    rot = RotaryEmbedding(Dh, 10000.0, P, YARN)
    cos_sin = rope_cos_sin(rot.inv_freq, rot.attention_scaling, P)
    positions = torch.randint(0, P, (T,), generator=g)
    qw = (1 + 0.2 * torch.randn(Dh, generator=g)).to(dtype) if norm else None
    kw = (1 + 0.2 * torch.randn(Dh, generator=g)).to(dtype) if norm else None
    kv_pool = slots = None
    if pool:
        kv_pool = poisoned_pool(Hkv, Dh, kv_dtype or dtype)
        slots = torch.randperm(ROWS, generator=g)[:T]
    return RopeCall(qkv, H, Hkv, Dh, positions, cos_sin, qw, kw, EPS, kv_pool, slots)


def poisoned_pool(Hkv: int, Dh: int, dtype) -> KVPool:
    """NaN codes (and NaN scales for fp8) in every row."""
    scales = [poisoned(ROWS, Hkv, dtype=torch.float32) for _ in range(2)] if dtype == FP8 else [None] * 2
    return KVPool(poisoned(ROWS, Hkv, Dh, dtype=dtype), poisoned(ROWS, Hkv, Dh, dtype=dtype), 16,
                  *scales)


def _copy_pool(pool: KVPool) -> KVPool:
    clone = (lambda t: None if t is None else t.clone())
    return KVPool(pool.k.clone(), pool.v.clone(), pool.block_size, clone(pool.k_scale), clone(pool.v_scale))


def _run(monkeypatch, route: str, call: RopeCall, layer: str = "test"):
    monkeypatch.setenv("LOWBIT_ROUTE_ROPE", route)
    return qk_norm_rope(call, layer=layer)


def check_pool(pool: KVPool, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Rows slots hold k and v; every other row is still NaN."""
    assert torch.equal(pool.k[slots], k) and torch.equal(pool.v[slots], v)
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.isnan(pool.k[untouched].float()).all() and torch.isnan(pool.v[untouched].float()).all()


@pytest.mark.parametrize("heads", [(4, 2, 32), (6, 1, 64), (32, 4, 128)])
@pytest.mark.parametrize("norm", [False, True])
def test_triton_matches_torch(monkeypatch, heads, norm):
    routes.reset_counters()
    for T in (1, 3, 17):
        call = make_call(T, heads, norm=norm, seed=T)
        ref_pool = _copy_pool(call.pool)
        q, k, v = _run(monkeypatch, TRITON, call)
        ref_call = make_call(T, heads, norm=norm, seed=T)
        ref_call.pool = ref_pool
        q_ref, k_ref, v_ref = _run(monkeypatch, "torch", ref_call)
        assert q.shape == (T, heads[0], heads[2]) and k.shape == v.shape == (T, heads[1], heads[2])
        if norm:
            assert_ulp_close(q, q_ref)
            assert_ulp_close(k, k_ref)
        else:
            assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
        assert torch.equal(v, v_ref)
        assert torch.equal(v, call.qkv.view(T, -1, heads[2])[:, heads[0] + heads[1]:])
        check_pool(call.pool, k, v, call.slot_mapping)
        check_pool(ref_pool, k_ref, v_ref, call.slot_mapping)
    ran = {(c["op"], c["route"]): c["count"] for c in routes.counters()["route_calls"]}
    assert ran == {("rope", TRITON): 3, ("rope", "torch"): 3, ("kv_write", "torch"): 3}


def test_negative_slot_writes_nothing(monkeypatch):
    """A token with slot -1 (the Triton route's padding convention) gets q, k, v but no pool row."""
    call = make_call(3, (4, 2, 32), seed=8)
    rows = call.slot_mapping.clone()
    call.slot_mapping[1] = -1
    _, k, v = _run(monkeypatch, TRITON, call)
    check_pool(call.pool, k[[0, 2]], v[[0, 2]], rows[[0, 2]])
    assert torch.isfinite(k[1]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_without_pool(monkeypatch, dtype):
    """fp16 and float32 (the CPU engine's dtype); head dim 24 pads its halves 12 -> 16."""
    for norm in (False, True):
        call = make_call(5, (3, 1, 24), dtype=dtype, norm=norm, pool=False, seed=7)
        got = _run(monkeypatch, TRITON, call)
        want = _run(monkeypatch, "torch", call)
        for a, b in zip(got, want):
            if dtype == torch.float32:
                torch.testing.assert_close(a, b, rtol=3e-6, atol=1e-6)
            else:
                assert_ulp_close(a, b)


def test_float32_weights_round_once(monkeypatch):
    """qk-norm weights in float32 with bf16 qkv: the weighted value stays float32 (as torch
    promotes) and the rotated value is rounded to bf16 once, in both routes."""
    call = make_call(3, (4, 2, 32), norm=True, pool=False, seed=9)
    call.q_weight, call.k_weight = call.q_weight.float(), call.k_weight.float()
    got = _run(monkeypatch, TRITON, call)
    want = _run(monkeypatch, "torch", call)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        assert_ulp_close(a, b)


def test_torch_route_matches_model_layers():
    """The torch route equals the layers' path: HF RMSNorm per head, then apply_rope with
    RotaryEmbedding's cos/sin at the positions; v is qkv's last Hkv heads, copied."""
    H, Hkv, Dh = 4, 2, 32
    call = make_call(6, (H, Hkv, Dh), norm=True, pool=False, seed=3)
    rot = RotaryEmbedding(Dh, 10000.0, P, YARN)
    table_cos, table_sin = rot(torch.arange(P))
    cos, sin = table_cos[call.positions], table_sin[call.positions]
    q, k, v = call.qkv.view(6, H + 2 * Hkv, Dh).split([H, Hkv, Hkv], dim=1)
    want_q = apply_rope(hf_rms_norm(q, call.q_weight, EPS), cos, sin)
    want_k = apply_rope(hf_rms_norm(k, call.k_weight, EPS), cos, sin)
    got_q, got_k, got_v = _run_torch(call)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(got_v, v)
    assert got_v.data_ptr() != v.data_ptr()


@pytest.mark.parametrize("rope", [None, YARN])
def test_cos_sin_table_matches_rotary_embedding(rope):
    rot = RotaryEmbedding(64, 10000.0, P, rope)
    cos, sin = rot(torch.arange(P))
    table = rope_cos_sin(rot.inv_freq, rot.attention_scaling, P)
    assert table.shape == (P, 64) and table.dtype == torch.float32
    assert torch.equal(table, torch.cat((cos, sin), dim=-1))
    assert (rot.attention_scaling != 1.0) == (rope is not None)


def test_partial_rotary_torch_route():
    """cos_sin [P, R] with R < Dh rotates the first R dims and passes the rest through (torch
    route only; the Triton route refuses it)."""
    call = make_call(3, (2, 1, 32), norm=False, pool=False, seed=4)
    rot = RotaryEmbedding(16, 10000.0, P)
    call.cos_sin = rope_cos_sin(rot.inv_freq, 1.0, P)
    call.forced = True
    assert "partial rotary" in _admit_triton(call)
    q, _, _ = _run_torch(call)
    q_in = call.qkv.view(3, 4, 32)[:, :2]
    cos, sin = rot(call.positions)
    assert torch.equal(q[..., :16], apply_rope(q_in[..., :16], cos, sin))
    assert torch.equal(q[..., 16:], q_in[..., 16:])


@pytest.mark.parametrize("norm", [False, True])
def test_fp8_pool_matches_torch(monkeypatch, norm):
    """fp8 pools: the Triton route stores the codes and per-token-per-head scales that the
    torch route (reference_kv_write) stores; other rows keep their NaN codes and scales."""
    call = make_call(17, (4, 2, 32), norm=norm, seed=5, kv_dtype=FP8)
    ref_pool = _copy_pool(call.pool)
    _, k, v = _run(monkeypatch, TRITON, call)
    ref_call = make_call(17, (4, 2, 32), norm=norm, seed=5, kv_dtype=FP8)
    ref_call.pool = ref_pool
    _, k_ref, v_ref = _run(monkeypatch, "torch", ref_call)
    want = poisoned_pool(2, 32, FP8)
    reference_kv_write(k, v, want, call.slot_mapping)  # from this route's own k, v
    for got, ref in ((call.pool.k, want.k), (call.pool.v, want.v)):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    for got, ref in ((call.pool.k_scale, want.k_scale), (call.pool.v_scale, want.v_scale)):
        assert torch.equal(got.nan_to_num(-1.0), ref.nan_to_num(-1.0))
    assert torch.isnan(call.pool.k_scale).sum() == (ROWS - 17) * 2
    if not norm:  # same k, v as the torch route: the same pool, byte for byte
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
        assert torch.equal(call.pool.k.view(torch.uint8), ref_pool.k.view(torch.uint8))


def test_forced_refusal_raises(monkeypatch):
    call = make_call(3, (4, 2, 32), seed=5, kv_dtype=torch.float16)
    monkeypatch.setenv("LOWBIT_ROUTE_ROPE", TRITON)
    with pytest.raises(LowbitError, match="KV pool is torch.float16, qkv is torch.bfloat16"):
        qk_norm_rope(call)
    monkeypatch.delenv("LOWBIT_ROUTE_ROPE")
    routes.reset_counters()
    qk_norm_rope(call, layer="L1")  # auto on the CPU: the torch route, the refusal counted
    refused = [(c["route"], c["layer"]) for c in routes.counters()["route_refusals"] if c["op"] == "rope"]
    assert refused == [(TRITON, "L1")]
    assert not torch.isnan(call.pool.k[call.slot_mapping]).any()


def test_refusals_and_validation():
    call = make_call(2, (4, 2, 32), seed=6)
    call.forced = True
    assert _admit_triton(call) is None
    call.pool = poisoned_pool(2, 32, FP8)
    assert _admit_triton(call) is None
    call.pool.v_scale = None
    assert "v_scale is not float32" in _admit_triton(call)
    big = make_call(1, (1, 1, 512), norm=False, pool=False)
    big.forced = True
    assert "head dim 512" in _admit_triton(big)
    wide = make_call(1, (2, 1, 32), dtype=torch.float64, pool=False)
    wide.forced = True
    assert "float64" in _admit_triton(wide)
    auto = make_call(1, (2, 1, 32), pool=False)
    assert "TRITON_INTERPRET=1 and a forced route" in _admit_triton(auto)
    bad = make_call(1, (2, 1, 32), pool=False)
    bad.k_weight = None
    with pytest.raises(ValueError, match="both q_weight and k_weight"):
        qk_norm_rope(bad)
    bad = make_call(1, (2, 1, 32), pool=False)
    bad.num_heads = 3
    with pytest.raises(ValueError, match="columns"):
        qk_norm_rope(bad)
