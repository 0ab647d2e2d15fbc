"""The `mla_rope` op (kv_a_layernorm + RoPE of q_pe and k_pe + latent cache write): the Triton
route against the torch route (forced through the registry, on the Triton interpreter), the
torch route against the model's former expression (RotaryEmbedding, apply_rope after a
de-interleave, the HF RMSNorm), and the refusals.

q and kv_a are views of one merged projection output between NaN guards (a read past its
ends, or into the q_nope columns of the wrong head, shows). Both routes write NaN-poisoned
latent pools at shuffled rows: written rows must hold the returned c_kv and k_pe, the rest
stay NaN. The rotations are the torch route's float32 ops, so they are equal; the norm sums
its squares in another order (ulp-close, see test_norm_op).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.errors import LowbitError  # noqa: E402
from lowbit.kernels import routes  # noqa: E402
from lowbit.kernels.attention import FP8, KVPool, reference_kv_write  # noqa: E402
from lowbit.kernels.mla_rope_op import MlaRopeCall, _admit_triton, deinterleave, mla_rope  # noqa: E402
from lowbit.kernels.rope_op import rope_cos_sin  # noqa: E402
from lowbit.kernels.runtime import interpreting  # noqa: E402
from lowbit.layers.rope import RotaryEmbedding, apply_rope  # noqa: E402
from tests.kernels.cases import guarded, poisoned  # noqa: E402
from tests.kernels.test_norm_op import assert_ulp_close, hf_rms_norm  # noqa: E402

EPS = 1e-6
P = 40  # table positions
ROWS = 48  # pool rows
TRITON = "triton_mla_rope"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.9,
        "mscale_all_dim": 0.7}
# (H, Dn, Dr, C): odd head counts and latent widths; the last is DeepSeek's C and Dr
SHAPES = [(3, 5, 6, 18), (20, 8, 12, 41), (16, 4, 64, 512)]

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """The Triton route's outputs start as NaN: an element it does not write shows."""
    from lowbit.kernels import mla_rope_op

    monkeypatch.setattr(mla_rope_op, "_empty", lambda shape, like: poisoned(*shape, dtype=like.dtype))


def make_call(T: int, shape, dtype=torch.bfloat16, interleaved=True, pool=True, kv_dtype=None,
              seed: int = 0) -> MlaRopeCall:
    H, Dn, Dr, C = shape
    g = torch.Generator().manual_seed(seed)
    Wq = H * (Dn + Dr)
    merged = guarded((torch.randn(T, Wq + 3 + C + Dr, generator=g) * 2).to(dtype))  # 3 unused columns
    q, kv_a = merged[:, :Wq], merged[:, Wq + 3:]
    rot = RotaryEmbedding(Dr, 10000.0, P, YARN)
    cos_sin = rope_cos_sin(rot.inv_freq, rot.attention_scaling, P)
    positions = torch.randint(0, P, (T,), generator=g)
    w = (1 + 0.2 * torch.randn(C, generator=g)).to(dtype)
    lat = slots = None
    if pool:
        lat = poisoned_pool(C, Dr, kv_dtype or dtype)
        slots = torch.randperm(ROWS, generator=g)[:T]
    return MlaRopeCall(q, kv_a, H, Dn, Dr, positions, cos_sin, w, EPS, interleaved, lat, slots)


def poisoned_pool(C: int, Dr: int, dtype) -> KVPool:
    scales = [poisoned(ROWS, 1, dtype=torch.float32) for _ in range(2)] if dtype == FP8 else [None] * 2
    return KVPool(poisoned(ROWS, 1, C, dtype=dtype), poisoned(ROWS, 1, Dr, dtype=dtype), 16, *scales)


def _run(monkeypatch, route: str, call: MlaRopeCall):
    monkeypatch.setenv("LOWBIT_ROUTE_MLA_ROPE", route)
    return mla_rope(call, layer="test")


def check_pool(pool: KVPool, c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
    """Rows `slots` hold what reference_kv_write stores for c_kv, k_pe; the others stay NaN."""
    want = poisoned_pool(c_kv.shape[-1], k_pe.shape[-1], pool.k.dtype)
    reference_kv_write(c_kv[:, None], k_pe[:, None], want, slots)
    for got, ref in ((pool.k, want.k), (pool.v, want.v), (pool.k_scale, want.k_scale),
                     (pool.v_scale, want.v_scale)):
        if ref is not None:
            assert torch.equal(got[slots].float(), ref[slots].float())
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.isnan(pool.k[untouched].float()).all() and torch.isnan(pool.v[untouched].float()).all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("interleaved", [True, False])
def test_triton_matches_torch(monkeypatch, shape, interleaved):
    routes.reset_counters()
    for T in (1, 3, 17):
        call = make_call(T, shape, interleaved=interleaved, seed=T)
        ref = make_call(T, shape, interleaved=interleaved, seed=T)
        q_pe, c_kv, k_pe = _run(monkeypatch, TRITON, call)
        q_ref, c_ref, k_ref = _run(monkeypatch, "torch", ref)
        H, Dn, Dr, C = shape
        assert q_pe.shape == (T, H, Dr) and c_kv.shape == (T, C) and k_pe.shape == (T, Dr)
        assert torch.equal(q_pe, q_ref) and torch.equal(k_pe, k_ref)
        assert_ulp_close(c_kv, c_ref, max_frac=5e-3)
        check_pool(call.pool, c_kv, k_pe, call.slot_mapping)
        check_pool(ref.pool, c_ref, k_ref, call.slot_mapping)
    ran = {(c["op"], c["route"]): c["count"] for c in routes.counters()["route_calls"]}
    assert ran == {("mla_rope", TRITON): 3, ("mla_rope", "torch"): 3, ("kv_write", "torch"): 3}


@pytest.mark.parametrize("dtype,kv", [(torch.bfloat16, FP8), (torch.float32, torch.float32),
                                      (torch.float16, torch.float16)])
def test_other_dtypes_and_fp8_pools(monkeypatch, dtype, kv):
    for T in (1, 5):
        call = make_call(T, SHAPES[1], dtype=dtype, kv_dtype=kv, seed=10 + T)
        ref = make_call(T, SHAPES[1], dtype=dtype, kv_dtype=kv, seed=10 + T)
        got = _run(monkeypatch, TRITON, call)
        want = _run(monkeypatch, "torch", ref)
        for a, b in zip(got, want):
            if dtype == torch.float32:
                torch.testing.assert_close(a, b, rtol=3e-6, atol=1e-6)
            else:
                assert_ulp_close(a, b, max_frac=5e-3)
        check_pool(call.pool, got[1], got[2], call.slot_mapping)


def test_negative_slot_writes_nothing_and_no_pool(monkeypatch):
    call = make_call(3, SHAPES[0], seed=8)
    rows = call.slot_mapping.clone()
    call.slot_mapping[1] = -1
    _, c_kv, k_pe = _run(monkeypatch, TRITON, call)
    check_pool(call.pool, c_kv[[0, 2]], k_pe[[0, 2]], rows[[0, 2]])
    bare = make_call(3, SHAPES[0], pool=False, seed=8)
    for a, b in zip(_run(monkeypatch, TRITON, bare), _run(monkeypatch, "torch", bare)):
        assert torch.isfinite(a).all()
        assert_ulp_close(a, b, max_frac=5e-2)


@pytest.mark.parametrize("interleaved", [True, False])
def test_torch_route_is_the_models_former_expression(monkeypatch, interleaved):
    """RotaryEmbedding's cos / sin per call, apply_rope after the de-interleave, the HF norm."""
    H, Dn, Dr, C = SHAPES[1]
    call = make_call(4, SHAPES[1], dtype=torch.float32, interleaved=interleaved, pool=False, seed=3)
    q_pe, c_kv, k_pe = _run(monkeypatch, "torch", call)
    cos, sin = RotaryEmbedding(Dr, 10000.0, P, YARN)(call.positions)
    perm = deinterleave if interleaved else (lambda x: x)
    q = call.q.view(4, H, Dn + Dr)[..., Dn:]
    assert torch.equal(q_pe, apply_rope(perm(q), cos, sin))
    assert torch.equal(k_pe, apply_rope(perm(call.kv_a[:, None, C:]), cos, sin)[:, 0])
    assert torch.equal(c_kv, hf_rms_norm(call.kv_a[:, :C], call.weight, EPS))


def _forced(**kw) -> MlaRopeCall:
    call = make_call(2, SHAPES[0], seed=1, **kw)
    call.forced = True  # CPU tensors: the interpreter admits forced calls only
    return call


def test_refusals(monkeypatch):
    assert "TRITON_INTERPRET" in _admit_triton(make_call(2, SHAPES[0], seed=1))
    call = _forced()
    assert _admit_triton(call) is None
    call.weight = call.weight.float()
    assert "norm weight" in _admit_triton(call)
    call = _forced()
    call.cos_sin = call.cos_sin.double()
    assert "cos_sin" in _admit_triton(call)
    assert "latent pool" in _admit_triton(_forced(kv_dtype=torch.float16))
    call = make_call(2, SHAPES[0], seed=1)
    monkeypatch.setenv("LOWBIT_ROUTE_MLA_ROPE", TRITON)
    call.weight = call.weight.float()
    with pytest.raises(LowbitError, match="norm weight"):
        mla_rope(call)
    with pytest.raises(ValueError, match="slot_mapping"):
        mla_rope(MlaRopeCall(call.q, call.kv_a, 3, 5, 6, call.positions, call.cos_sin, call.weight, EPS, True,
                             call.pool, None))
