"""MLA decode over the paged latent cache (lowbit/kernels/latent.py) against its twin, and
the `latent_attention` op's routes: admission, the cache write, graph safety.

Pools are poisoned with NaN before the writes (a read past a sequence's end shows) and so
are outputs (an unwritten element shows). Blocks are handed out shuffled, so tables are not
monotonic. Head counts are not multiples of the head block, latent widths not powers of
two, lengths cross blocks and tiles and leave some splits empty. The twin computes in
float32 from the pool's stored values (fp8: the same codes and scales), so the error is the
kernel's rounding of P to the KV dtype before the PV product.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.engine.batch import ForwardBatch  # noqa: E402
from lowbit.engine.kv_cache import ContiguousKVCache  # noqa: E402
from lowbit.engine.paged_cache import PagedKVCache  # noqa: E402
from lowbit.engine.speculative import flat_batch  # noqa: E402
from lowbit.errors import LowbitError  # noqa: E402
from lowbit.kernels import attention_op, routes  # noqa: E402
from lowbit.kernels.attention import FP8, KVPool, reference_kv_write  # noqa: E402
from lowbit.kernels.latent import latent_decode, latent_prefill, reference_latent_decode  # noqa: E402
from lowbit.kernels.runtime import interpreting  # noqa: E402
from tests.kernels.cases import poisoned, rel_err  # noqa: E402

BS = 16
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")


def make_latent_pool(seq_lens: list[int], C: int, Dr: int, kv_dtype: torch.dtype, dtype: torch.dtype,
                     seed: int) -> tuple[KVPool, torch.Tensor]:
    """A NaN-poisoned one-head pool (c_kv [R, 1, C], k_pe [R, 1, Dr]) holding each
    sequence's tokens, and its block tables (shuffled blocks, padding names a spare one)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in seq_lens]
    num_blocks = sum(need) + 2
    rows = (num_blocks + 1) * BS
    fp8 = kv_dtype == FP8
    pool = KVPool(poisoned(rows, 1, C, dtype=kv_dtype), poisoned(rows, 1, Dr, dtype=kv_dtype), BS,
                  poisoned(rows, 1, dtype=torch.float32) if fp8 else None,
                  poisoned(rows, 1, dtype=torch.float32) if fp8 else None)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seq_lens), max(need) + 1), num_blocks, dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slots = tables[b][pos // BS].long() * BS + pos % BS
        reference_kv_write(torch.randn(n, 1, C, generator=g).to(dtype),
                           torch.randn(n, 1, Dr, generator=g).to(dtype), pool, slots)
    return pool, tables


CASES = (([40], 1, None), ([1, 17, 40, 5], 3, dict(BN=16)), ([33, 9], 4, dict(BN=16)))


@pytest.mark.parametrize("dtype,kv", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8),
                                      (torch.float32, torch.float32)])
@pytest.mark.parametrize("heads", [(20, 40, 12), (3, 18, 6)])  # H, C, Dr
def test_latent_decode_matches_twin(dtype, kv, heads):
    H, C, Dr = heads
    for i, (lens, splits, cfg) in enumerate(CASES):
        pool, tables = make_latent_pool(lens, C, Dr, kv, dtype, seed=i)
        g = torch.Generator().manual_seed(100 + i)
        q_lat = torch.randn(len(lens), H, C, generator=g).to(dtype)
        q_pe = torch.randn(len(lens), H, Dr, generator=g).to(dtype)
        out = poisoned(len(lens), H, C, dtype=dtype)
        scale = 0.3
        latent_decode(q_lat, q_pe, pool, tables, torch.tensor(lens, dtype=torch.int32), scale, out=out,
                      num_splits=splits, config=cfg)
        ref = reference_latent_decode(q_lat, q_pe, pool, tables, lens, scale)
        assert rel_err(out, ref) < TOL[dtype], (lens, splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reduce_merges_only_live_splits_over_column_blocks(monkeypatch, dtype):
    """A wide S (8) over short contexts: most splits hold no key and write nothing (their
    partial rows stay NaN), the reduce merges the live ones two at a time (RS = 2: several
    tiles with the online max) over 16-column blocks of a latent of 40 (the last block
    masked)."""
    from lowbit.kernels import latent

    monkeypatch.setattr(latent, "REDUCE_SPLITS", 2)
    monkeypatch.setattr(latent, "REDUCE_COLS", 16)
    monkeypatch.setattr(latent, "_workspace", lambda n, device: poisoned(n, dtype=torch.float32, device=device))
    lens = [1, 70, 33]
    H, C, Dr = 3, 40, 6
    pool, tables = make_latent_pool(lens, C, Dr, dtype, dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    q_lat = torch.randn(3, H, C, generator=g).to(dtype)
    q_pe = torch.randn(3, H, Dr, generator=g).to(dtype)
    out = poisoned(3, H, C, dtype=dtype)
    latent_decode(q_lat, q_pe, pool, tables, torch.tensor(lens, dtype=torch.int32), 0.3, out=out,
                  num_splits=8, config=dict(BN=16))
    ref = reference_latent_decode(q_lat, q_pe, pool, tables, lens, 0.3)
    assert rel_err(out, ref) < TOL[dtype]


def test_deepseek_shape_with_strided_queries():
    """C = 512, Dr = 64, H = 16 (DeepSeek-V2-Lite), queries as non-contiguous views, and the
    default split count and tile config."""
    lens = [70, 3]
    pool, tables = make_latent_pool(lens, 512, 64, torch.bfloat16, torch.bfloat16, seed=7)
    g = torch.Generator().manual_seed(8)
    q_lat = torch.randn(16, 2, 512, generator=g).bfloat16().transpose(0, 1)  # [B, H, C], stride_h != C
    q_pe = torch.randn(2, 16, 80, generator=g).bfloat16()[..., 8:72]
    out = latent_decode(q_lat, q_pe, pool, tables, torch.tensor(lens, dtype=torch.int32), 0.07)
    ref = reference_latent_decode(q_lat, q_pe, pool, tables, lens, 0.07)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


def _w_uv(H: int, Dn: int, Dv: int, C: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """W_UV [H, Dv, C] as the model passes it: the rows Dn.. of kv_b_proj's [H, Dn + Dv, C],
    whose W_UK rows (and the buffer's ends) are NaN, so a read outside W_UV shows."""
    w = poisoned(H, Dn + Dv, C, dtype=dtype)
    w[:, Dn:] = (torch.randn(H, Dv, C, generator=torch.Generator().manual_seed(seed)) * 0.2).to(dtype)
    return w[:, Dn:]


def _uv_reference(ctx: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """W_UV[h] @ context[t, h] in float32, from the context rounded to its dtype."""
    return torch.einsum("thc,hvc->thv", ctx.float(), w_uv.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits,rs,cols", [(3, 16, 128), (8, 2, 16)])
def test_reduce_applies_w_uv(monkeypatch, dtype, splits, rs, cols):
    """The reduce launch with W_UV: the merged context times W_UV per head, [B, H, Dv], against
    the twin's context and a float32 product. Dv = 20 and C = 40 are not powers of two (the
    last value and column blocks are masked); RS = 2 / 16-column blocks make the merge loop
    over several split tiles and column blocks; short contexts leave splits empty (their
    partial rows NaN) and the output is NaN-poisoned."""
    from lowbit.kernels import latent

    monkeypatch.setattr(latent, "REDUCE_SPLITS", rs)
    monkeypatch.setattr(latent, "REDUCE_COLS", cols)
    monkeypatch.setattr(latent, "UV_ROWS", 16)  # two value blocks a head, the second masked
    monkeypatch.setattr(latent, "_workspace", lambda n, device: poisoned(n, dtype=torch.float32, device=device))
    lens = [1, 70, 33]
    H, C, Dr, Dv = 3, 40, 6, 20
    pool, tables = make_latent_pool(lens, C, Dr, dtype, dtype, seed=15)
    g = torch.Generator().manual_seed(16)
    q_lat = torch.randn(3, H, C, generator=g).to(dtype)
    q_pe = torch.randn(3, H, Dr, generator=g).to(dtype)
    w_uv = _w_uv(H, 7, Dv, C, dtype, seed=17)
    out = poisoned(3, H, Dv, dtype=dtype)
    latent_decode(q_lat, q_pe, pool, tables, torch.tensor(lens, dtype=torch.int32), 0.3, out=out,
                  num_splits=splits, config=dict(BN=16), w_uv=w_uv)
    ctx = reference_latent_decode(q_lat, q_pe, pool, tables, lens, 0.3)  # [B, H, C] in dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, _uv_reference(ctx, w_uv)) < TOL[dtype]


PREFILL_CASES = (([40], [40]), ([17, 40, 5, 1], [17, 1, 3, 1]), ([33, 9], [2, 9]))  # (seq_lens, new tokens)


@pytest.mark.parametrize("dtype,kv", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8),
                                      (torch.float32, torch.float32)])
@pytest.mark.parametrize("heads", [(20, 40, 12), (3, 18, 6)])  # H, C, Dr
def test_latent_prefill_matches_twin(dtype, kv, heads):
    """Prompts, chunks over a cached prefix and single decode tokens in one step: token t of
    sequence b attends over its causal prefix (the twin: one query per token over the same
    table row, cut at its position)."""
    H, C, Dr = heads
    for i, (lens, news) in enumerate(PREFILL_CASES):
        pool, tables = make_latent_pool(lens, C, Dr, kv, dtype, seed=20 + i)
        T = sum(news)
        g = torch.Generator().manual_seed(200 + i)
        q_lat = torch.randn(T, H, C, generator=g).to(dtype)
        q_pe = torch.randn(T, H, Dr, generator=g).to(dtype)
        starts = torch.tensor([0] + news, dtype=torch.int32).cumsum(0).to(torch.int32)
        out = poisoned(T, H, C, dtype=dtype)
        latent_prefill(q_lat, q_pe, pool, tables, torch.tensor(lens, dtype=torch.int32), starts, 0.3, out=out,
                       config=dict(BN=16))
        rows = [b for b, n in enumerate(news) for _ in range(n)]
        pos = [lens[b] - news[b] + j for b, n in enumerate(news) for j in range(n)]
        ref = reference_latent_decode(q_lat, q_pe, pool, tables[rows], [p + 1 for p in pos], 0.3)
        assert rel_err(out, ref) < TOL[dtype], (lens, news)


# -- the op ----------------------------------------------------------------------------------
C, DR, H = 24, 8, 5


def _paged_cache(kv: torch.dtype) -> PagedKVCache:
    """A one-layer pool of 8 blocks of 4, poisoned before any write."""
    cache = PagedKVCache(1, num_blocks=8, block_size=4, dtype=kv, device="cpu")
    pool = cache.layer_pool(0, torch.empty(0, 1, C), torch.empty(0, 1, DR))
    for t in pool:
        if isinstance(t, torch.Tensor):
            t.fill_(float("nan"))
    return cache


def _step(cache, entries, seed: int, dtype=torch.float32):
    """A latent call for (block table, cached, new) entries over the cache, fresh inputs."""
    g = torch.Generator().manual_seed(seed)
    T = sum(n for _, _, n in entries)
    batch = flat_batch(entries, cache, "cpu") if isinstance(cache, PagedKVCache) else \
        ForwardBatch.build([n for _, _, n in entries], [s for _, s, _ in entries], None, cache)
    return attention_op.LatentCall(torch.randn(T, H, C, generator=g).to(dtype),
                                   torch.randn(T, H, DR, generator=g).to(dtype),
                                   torch.randn(T, C, generator=g).to(dtype),
                                   torch.randn(T, DR, generator=g).to(dtype), batch, 0, 0.25)


@pytest.mark.parametrize("kv", [torch.float32, FP8])
def test_decode_route_writes_and_reads_like_the_torch_route(kv, monkeypatch):
    """Prompts of 6 and 9 tokens prefill through the torch route; a decode step through the
    forced Triton route then stores the same pool values (fp8: codes and scales) as the torch
    route's `update`, and returns its output."""
    cache = _paged_cache(kv)
    tables = [[5, 1, 7], [0, 3, 6]]
    monkeypatch.delenv("LOWBIT_ROUTE_LATENT_ATTENTION", raising=False)
    attention_op.latent_attention(_step(cache, [(tables[0], 0, 6), (tables[1], 0, 9)], seed=1))
    call = _step(cache, [(tables[0], 6, 1), (tables[1], 9, 1)], seed=2)
    assert call.batch.mode.is_decode
    want = attention_op.latent_attention(call)
    live = [t for t in (cache.k[0], cache.v[0], cache.k_scale[0], cache.v_scale[0]) if t is not None]
    stored = [t.clone() for t in live]
    for t in live:
        t.view(torch.uint8)[call.batch.slot_mapping] = 255  # the rows the step writes: NaN again
    monkeypatch.setenv("LOWBIT_ROUTE_LATENT_ATTENTION", "triton_latent_decode")
    routes.reset_counters()
    got = attention_op.latent_attention(call)
    ran = {(c["op"], c["route"]) for c in routes.counters()["route_calls"]}
    assert ran == {("latent_attention", "triton_latent_decode"), ("kv_write", "torch")}
    for a, b in zip(live, stored):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("kv", [torch.float32, FP8])
def test_prefill_route_writes_and_reads_like_the_torch_route(kv, monkeypatch):
    """Prompts of 6 and 9 tokens, then a mixed step (a decode token beside a 3-token chunk):
    the forced Triton prefill route on one cache and the torch route on another store the
    same pool bytes (fp8: codes and scales) and return the same context."""
    tables = [[5, 1, 7], [0, 3, 6]]
    caches = {"torch": _paged_cache(kv), "triton_latent_prefill": _paged_cache(kv)}
    for seed, entries in ((11, [(tables[0], 0, 6), (tables[1], 0, 9)]),
                          (12, [(tables[0], 6, 1), (tables[1], 9, 3)])):
        outs = {}
        for route, cache in caches.items():
            monkeypatch.setenv("LOWBIT_ROUTE_LATENT_ATTENTION", route)
            call = _step(cache, entries, seed=seed)
            assert not call.batch.mode.is_decode
            routes.reset_counters()
            outs[route] = attention_op.latent_attention(call)
            ran = {c["route"] for c in routes.counters()["route_calls"] if c["op"] == "latent_attention"}
            assert ran == {route}
        assert rel_err(outs["triton_latent_prefill"], outs["torch"]) < 1e-5
        a, b = caches["torch"], caches["triton_latent_prefill"]
        for x, y in zip((a.k[0], a.v[0], a.k_scale[0], a.v_scale[0]), (b.k[0], b.v[0], b.k_scale[0], b.v_scale[0])):
            if x is not None:
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("route", ["triton_latent_decode_uv", "triton_latent_decode", "triton_latent_prefill"])
def test_every_route_applies_w_uv_like_the_torch_route(route, monkeypatch):
    """With W_UV given the op returns [T, H, Dv] whatever the route: the fused reduce
    (decode), the split kernel then a batched GEMM (decode), the prefill kernel then the GEMM
    (a mixed step), each against the torch route on a twin cache."""
    from lowbit.kernels import latent

    monkeypatch.setattr(latent, "decode_splits", lambda *a: 4)  # CPU: S = 1 would refuse the fused route
    tables = [[5, 1, 7], [0, 3, 6]]
    decode = route != "triton_latent_prefill"
    steps = ((21, [(tables[0], 0, 6), (tables[1], 0, 9)]),
             (22, [(tables[0], 6, 1), (tables[1], 9, 1 if decode else 3)]))
    caches = {"torch": _paged_cache(torch.float32), route: _paged_cache(torch.float32)}
    w_uv = _w_uv(H, 5, 12, C, torch.float32, seed=23)
    for seed, entries in steps:
        outs = {}
        for name, cache in caches.items():
            monkeypatch.setenv("LOWBIT_ROUTE_LATENT_ATTENTION", name if seed == 22 else "torch")
            call = _step(cache, entries, seed=seed)
            call.w_uv = w_uv
            routes.reset_counters()
            outs[name] = attention_op.latent_attention(call)
        assert outs[route].shape == (call.q_lat.shape[0], H, 12)
    ran = {c["route"] for c in routes.counters()["route_calls"] if c["op"] == "latent_attention"}
    assert ran == {route}
    assert torch.isfinite(outs[route]).all()
    assert rel_err(outs[route], outs["torch"]) < 1e-5


def test_fused_w_uv_route_admission(monkeypatch):
    from lowbit.kernels import latent

    route = {r.name: r for r in routes.ops()["latent_attention"].routes}["triton_latent_decode_uv"]
    cache = _paged_cache(torch.float32)
    call = _step(cache, [([0, 1], 5, 1), ([2], 2, 1)], seed=31)
    call.forced = True
    assert "no W_UV given" in route.admit(call)
    call.w_uv = _w_uv(H, 3, 8, C, torch.float32, seed=32)
    monkeypatch.setattr(latent, "decode_splits", lambda *a: 1)
    assert "one split" in route.admit(call)
    monkeypatch.setattr(latent, "decode_splits", lambda *a: 4)
    assert route.admit(call) is None
    call.w_uv = call.w_uv[:2]
    assert "does not fit" in route.admit(call)
    many = _step(cache, [([b % 8], 1, 1) for b in range(attention_op.LATENT_UV_MAX_TOKENS + 1)], seed=33)
    many.forced, many.w_uv = True, _w_uv(H, 3, 8, C, torch.float32, seed=34)
    assert "batched GEMM reads it once a step" in route.admit(many)
    # first in selection order (an A/B's --variant makes it the first choice), OPT_IN until
    # its engine record, and graph-safe
    assert routes.ops()["latent_attention"].routes[0].name == "triton_latent_decode_uv"
    assert route.status == routes.OPT_IN
    assert "triton_latent_decode_uv" in attention_op.GRAPH_SAFE_LATENT_DECODE


def test_latent_route_admission_reasons(monkeypatch):
    route = {r.name: r for r in routes.ops()["latent_attention"].routes}["triton_latent_decode"]
    cache = _paged_cache(torch.float32)
    call = _step(cache, [([0, 1], 5, 1), ([2], 2, 1)], seed=3)
    call.forced = True
    assert route.admit(call) is None
    call.forced = False
    assert "TRITON_INTERPRET=1 and a forced route" in route.admit(call)
    prefill = _step(cache, [([0, 1], 0, 6)], seed=4)
    mixed = _step(cache, [([0, 1], 5, 1), ([2], 0, 3)], seed=5)
    contiguous = _step(ContiguousKVCache(1, 2, 16), [(None, 5, 1), (None, 2, 1)], seed=6)
    wide = _step(cache, [([0, 1], 5, 1)], seed=7, dtype=torch.float64)
    bf16 = _step(cache, [([0, 1], 5, 1)], seed=8, dtype=torch.bfloat16)
    for c in (prefill, mixed, contiguous, wide, bf16):
        c.forced = True
    assert "not a decode step" in route.admit(prefill)
    assert "not a decode step" in route.admit(mixed)
    prefill_route = {r.name: r for r in routes.ops()["latent_attention"].routes}["triton_latent_prefill"]
    assert prefill_route.admit(prefill) is None and prefill_route.admit(mixed) is None
    assert "no paged KV pool" in prefill_route.admit(contiguous)
    assert "no paged KV pool" in route.admit(contiguous)
    assert "queries are torch.float64" in route.admit(wide)
    assert route.admit(bf16) == "KV pool is torch.float32, queries are torch.bfloat16"
    status = {r.name: r.status for r in routes.ops()["latent_attention"].routes}
    assert status == {"triton_latent_decode_uv": routes.OPT_IN, "triton_latent_decode": routes.DEFAULT,
                      "triton_latent_prefill": routes.DEFAULT, "torch": routes.DEFAULT}
    monkeypatch.setenv("LOWBIT_ROUTE_LATENT_ATTENTION", "triton_latent_decode")
    with pytest.raises(LowbitError, match="not a decode step"):
        attention_op.latent_attention(prefill)


def test_graph_safety_of_the_latent_op(monkeypatch):
    monkeypatch.delenv("LOWBIT_ROUTE_LATENT_ATTENTION", raising=False)
    monkeypatch.delenv("LOWBIT_ROUTE_ATTENTION", raising=False)
    assert attention_op.decode_graph_refusal("latent_attention") is None  # the DEFAULT route is safe
    monkeypatch.setenv("LOWBIT_ROUTE_LATENT_ATTENTION", "torch")
    reason = attention_op.decode_graph_refusal("latent_attention")
    assert "LOWBIT_ROUTE_LATENT_ATTENTION=torch is not a graph-safe decode route" == reason
    assert attention_op.decode_graph_refusal() is None  # the GQA op is not concerned
    monkeypatch.setenv("LOWBIT_ROUTE_LATENT_ATTENTION", "triton_latent_decode")
    assert attention_op.decode_graph_refusal("latent_attention") is None
    assert "not a graph-safe prefill route" in attention_op.prefill_graph_refusal("latent_attention")
    monkeypatch.delenv("LOWBIT_ROUTE_LATENT_ATTENTION")
    assert attention_op.prefill_graph_refusal("latent_attention") is None
    monkeypatch.setenv("LOWBIT_ROUTE_LATENT_ATTENTION", "torch")
    assert "torch is not a graph-safe prefill route" in attention_op.prefill_graph_refusal("latent_attention")


def test_torch_route_refuses_a_graph_batch_with_a_runtime_error():
    """A CUDA graph's static batch has no per-sequence slots: the torch route raises a
    RuntimeError naming the synchronization, which the graph warm-up turns into an eager
    bucket (lowbit.engine.cuda_graphs) instead of a crash."""
    cache = _paged_cache(torch.float32)
    call = _step(cache, [([0, 1], 5, 1)], seed=9)
    call.batch.cache_slots = [None]
    with pytest.raises(RuntimeError, match="synchroniz"):
        attention_op._run_latent_torch(call)
