"""The fused MLA decode layer on the GPU: the mla_rope kernel (kv_a_layernorm + RoPE of q_pe
and k_pe + latent cache write) at DeepSeek sizes against its torch twin and replayed from a
CUDA graph at other positions and slots; the latent reduce over a wide graph-static split
count at B = 1 (only live splits merged); and a small random DeepSeek model in the engine in
its serving layout (merged projections, merged shared gate/up), whose captured decode step
gives the eager step's logits and whose eager step runs the fused routes (no kv_write call).

Sizes: C = 512, Dr = 64 (V2-Lite and V3), H = 16 with Dn = 128 (V2-Lite: q_proj) and
H = 128 (V3), T up to 257. Tolerances: the rotations are float32 ops that the GPU may fuse
into FMAs, the norm sums its squares in another order: a few bf16 ulps on rare elements
(relative error checked, plus the argmax of the logits).
"""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.runtime import interpreting

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET=1 is set: GPU tests run compiled kernels"),
]

C, DR = 512, 64
ROWS = 1024
RTOL = 1e-2


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def _call(T: int, H: int, Dn: int, fp8: bool, interleaved: bool, seed: int):
    from lowbit.kernels.attention import FP8, KVPool
    from lowbit.kernels.mla_rope_op import MlaRopeCall
    from lowbit.layers.rope import RotaryEmbedding

    g = torch.Generator(device="cuda").manual_seed(seed)
    Wq = H * (Dn + DR)
    merged = (torch.randn(T, Wq + C + DR, generator=g, device="cuda") * 2).bfloat16()
    rot = RotaryEmbedding(DR, 10000.0, 4096, {"rope_type": "yarn", "factor": 40.0,
                                              "original_max_position_embeddings": 4096,
                                              "mscale": 0.707, "mscale_all_dim": 0.707}, table=True).cuda()
    dt = FP8 if fp8 else torch.bfloat16

    def nan(*shape, dtype=dt):
        return torch.full(shape, float("nan"), device="cuda").to(dtype)

    pool = KVPool(nan(ROWS, 1, C), nan(ROWS, 1, DR), 16, nan(ROWS, 1, dtype=torch.float32) if fp8 else None,
                  nan(ROWS, 1, dtype=torch.float32) if fp8 else None)
    positions = torch.randint(0, 4096, (T,), generator=g, device="cuda")
    slots = torch.randperm(ROWS, generator=g, device="cuda")[:T]
    w = (1 + 0.2 * torch.randn(C, generator=g, device="cuda")).bfloat16()
    return MlaRopeCall(merged[:, :Wq], merged[:, Wq:], H, Dn, DR, positions, rot.cos_sin, w, 1e-6,
                       interleaved, pool, slots)


def _pool_values(call):
    """The written rows of the pool as float32 values (fp8: codes times scales)."""
    pool, rows = call.pool, call.slot_mapping
    k, v = pool.k[rows].float(), pool.v[rows].float()
    if pool.is_fp8:
        k, v = k * pool.k_scale[rows][..., None], v * pool.v_scale[rows][..., None]
    return k[:, 0], v[:, 0]


@pytest.mark.parametrize("H,Dn", [(16, 128), (128, 128)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("interleaved", [True, False])
def test_mla_rope_matches_twin(monkeypatch, H, Dn, fp8, interleaved):
    from lowbit.kernels.mla_rope_op import mla_rope

    for T in (1, 8, 257):
        outs, pools = {}, {}
        for route in ("triton_mla_rope", "torch"):
            call = _call(T, H, Dn, fp8, interleaved, seed=T)
            monkeypatch.setenv("LOWBIT_ROUTE_MLA_ROPE", route)
            outs[route] = mla_rope(call)
            pools[route] = _pool_values(call)
            untouched = torch.ones(ROWS, dtype=torch.bool, device="cuda")
            untouched[call.slot_mapping] = False
            assert torch.isnan(call.pool.k[untouched].float()).all()
        for got, want in zip(outs["triton_mla_rope"], outs["torch"]):
            assert _rel(got, want) < 2e-3
        for got, want in zip(pools["triton_mla_rope"], pools["torch"]):
            assert _rel(got, want) < (3e-2 if fp8 else 2e-3)


def test_mla_rope_replays_from_a_graph(monkeypatch):
    """Captured once; new positions and slots copied into the same buffers; the replay
    writes what an eager call with them writes."""
    from lowbit.kernels.mla_rope_op import mla_rope

    monkeypatch.setenv("LOWBIT_ROUTE_MLA_ROPE", "triton_mla_rope")
    call = _call(4, 16, 128, False, True, seed=1)
    mla_rope(call)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = mla_rope(call)
    other = _call(4, 16, 128, False, True, seed=2)
    call.positions.copy_(other.positions)
    call.slot_mapping.copy_(other.slot_mapping)
    other.q.copy_(call.q)
    other.kv_a.copy_(call.kv_a)
    other.weight.copy_(call.weight)  # the norm weight is the call's own (drawn per seed)
    graph.replay()
    want = mla_rope(other)
    for name, got, ref in zip(("q_pe", "c_kv", "k_pe"), outs, want):
        assert torch.equal(got, ref), (name, (got.float() - ref.float()).abs().max())
    assert torch.equal(call.pool.k[call.slot_mapping], other.pool.k[other.slot_mapping])


@pytest.mark.parametrize("lens", [[100], [5000], [1, 3000]])
def test_latent_reduce_merges_live_splits_of_a_wide_split_count(lens):
    """S = 128 (the split count of a B = 1 graph over a 16K table): a short context leaves
    most splits empty, which write nothing; the graph replays at another length."""
    from lowbit.kernels.latent import latent_decode, reference_latent_decode
    from tests.gpu.test_latent_attention_gpu import _latent_pool, _queries

    pool, tables = _latent_pool(lens, False, seed=len(lens), spare_blocks=1024 // 16)
    q_lat, q_pe = _queries(len(lens), 16, seed=3)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q_lat, float("nan"))
    latent_decode(q_lat, q_pe, pool, tables, seq_lens, 0.07, out=out, num_splits=128)
    assert _rel(out, reference_latent_decode(q_lat, q_pe, pool, tables, lens, 0.07)) < RTOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        latent_decode(q_lat, q_pe, pool, tables, seq_lens, 0.07, out=out, num_splits=128)
    shorter = [max(1, n // 3) for n in lens]
    seq_lens.copy_(torch.tensor(shorter, dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    assert _rel(out, reference_latent_decode(q_lat, q_pe, pool, tables, shorter, 0.07)) < RTOL


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_captured_fused_decode_step_equals_eager(tmp_path, monkeypatch, version):
    """The engine serves the merged layout; with no route forced an eager decode step runs the
    DEFAULT fused routes (triton_mla_rope writes the latent: no kv_write call); one decode
    step replayed from its graph gives the logits and greedy tokens of the same step run
    eagerly."""
    from tests.gpu.test_latent_attention_gpu import _deepseek_dir, _engine, replayed_and_eager_step

    for op in ("MLA_ROPE", "ACT", "LATENT_ATTENTION"):
        monkeypatch.delenv(f"LOWBIT_ROUTE_{op}", raising=False)
    engine = _engine(_deepseek_dir(tmp_path / "m", version), max_model_len=2048)
    attn = engine.model.model.layers[0].self_attn
    assert attn.qkv_a_proj is not None, "prepare_for_serving did not merge the projections"
    assert engine.model.model.layers[-1].mlp.shared_experts.gate_up_proj is not None
    tokens, logits, eager, ran = replayed_and_eager_step(engine)
    ran = {pair for pair in ran if pair[0] in ("mla_rope", "latent_attention", "kv_write", "act")}
    assert ran == {("mla_rope", "triton_mla_rope"), ("latent_attention", "triton_latent_decode"),
                   ("act", "triton_silu_mul")}, ran
    assert _rel(logits, eager) < RTOL
    assert torch.equal(tokens, logits.argmax(-1))
