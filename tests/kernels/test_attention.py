"""Paged attention (KV write, split-KV decode, varlen prefill) against the torch twins, the
`attention` routes, and the demo model's greedy text with the Triton route forced.

Pools are poisoned with NaN before the writes (a read past a sequence's end shows) and so
are outputs (an unwritten element shows). Blocks are handed out shuffled, so tables are not
monotonic. The twin computes in float32 from the pool's stored values (fp8: the same codes
and scales), so the error is the kernels' rounding of P to the KV dtype before the PV
product: bf16 rel 1e-2, fp16 rel 2e-3, float32 rel 1e-5.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import lowbit  # noqa: E402
from lowbit.engine.paged_cache import FP8_MAX, PagedKVCache, SeqSlots  # noqa: E402
from lowbit.errors import LowbitError  # noqa: E402
from lowbit.kernels import attention_op, routes  # noqa: E402
from lowbit.kernels.attention import (  # noqa: E402
    _E4M3_F16_PTX,
    FP8,
    KVPool,
    fp8_words,
    paged_decode,
    paged_prefill,
    reference_kv_write,
    reference_paged_attention,
)
from lowbit.kernels.attention import FP8_MAX as KERNEL_FP8_MAX  # noqa: E402
from lowbit.kernels.runtime import interpreting  # noqa: E402
from tests.kernels.cases import poisoned, rel_err  # noqa: E402

BS = 16
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
HEADS = [(4, 2, 32), (6, 1, 64)]  # H, Hkv, D

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")


def make_pool(seq_lens: list[int], hkv: int, d: int, kv_dtype: torch.dtype, dtype: torch.dtype,
              seed: int) -> tuple[KVPool, torch.Tensor]:
    """A NaN-poisoned pool holding each sequence's seq_lens[b] tokens, and its block tables."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in seq_lens]
    num_blocks = sum(need) + 2  # spare blocks stay poisoned
    rows = (num_blocks + 1) * BS
    fp8 = kv_dtype == FP8
    pool = KVPool(poisoned(rows, hkv, d, dtype=kv_dtype), poisoned(rows, hkv, d, dtype=kv_dtype), BS,
                  poisoned(rows, hkv, dtype=torch.float32) if fp8 else None,
                  poisoned(rows, hkv, dtype=torch.float32) if fp8 else None)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seq_lens), max(need)), num_blocks, dtype=torch.int32)  # pad: scratch
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slots = tables[b][pos // BS].long() * BS + pos % BS
        k = torch.randn(n, hkv, d, generator=g).to(dtype)
        v = torch.randn(n, hkv, d, generator=g).to(dtype)
        reference_kv_write(k, v, pool, slots)
    return pool, tables


def _sinks(on: bool, h: int) -> torch.Tensor | None:
    return torch.randn(h, generator=torch.Generator().manual_seed(h)) if on else None


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_paged_decode_matches_twin(heads, window, sinks, kv):
    H, Hkv, D = heads
    kv_dtype = FP8 if kv == "fp8" else torch.bfloat16
    cases = (([40], 1, None), ([1, 17, 40], 3, dict(BN=16)), ([33, 5], 4, dict(BN=16, FOLD=True)),
             ([1, 40, 100], 9, dict(BN=16, FOLD=True)))  # 1, 3 and 7 of 9 splits hold keys
    for i, (lens, splits, cfg) in enumerate(cases):
        pool, tables = make_pool(lens, Hkv, D, kv_dtype, torch.bfloat16, seed=i)
        q = torch.randn(len(lens), H, D).bfloat16()
        sk = _sinks(sinks, H)
        out = poisoned(len(lens), H, D, dtype=torch.bfloat16)
        paged_decode(q, pool, tables, torch.tensor(lens, dtype=torch.int32), D ** -0.5, window, sk,
                     out=out, num_splits=splits, config=cfg)
        ref = reference_paged_attention(q, pool, tables, list(range(len(lens) + 1)), lens, D ** -0.5,
                                        window, sk)
        assert rel_err(out, ref) < TOL[torch.bfloat16], (lens, splits)


def test_folded_merge_resets_its_counters():
    """The last split of each (sequence, kv head) merges the partials; its counter goes back
    to 0, or the next call would never find its last split and leave the output unwritten
    (poisoned rows stay NaN). Folded and separate-launch merges agree."""
    H, Hkv, D = HEADS[-1]
    lens = [70, 3, 129]
    pool, tables = make_pool(lens, Hkv, D, torch.bfloat16, torch.bfloat16, seed=11)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = None
    for fold in (True, True, False):
        q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(5)).bfloat16()
        out = poisoned(len(lens), H, D, dtype=torch.bfloat16)
        paged_decode(q, pool, tables, seq_lens, D ** -0.5, None, _sinks(True, H), out=out,
                     num_splits=5, config=dict(BN=16, FOLD=fold))
        assert not out.float().isnan().any()
        ref = out if ref is None else ref
        assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_paged_prefill_matches_twin(heads, window, sinks, kv):
    """Sequences: a fresh prompt, a decode-like single query over 16 cached tokens, and a
    17-token chunk over 23 cached tokens (blocks and tiles crossed)."""
    H, Hkv, D = heads
    kv_dtype = FP8 if kv == "fp8" else torch.bfloat16
    for i, (ctx, qlens, cfg) in enumerate((([0], [17], None),
                                           ([0, 16, 23], [17, 1, 17], dict(BM=16, BN=16)))):
        lens = [c + n for c, n in zip(ctx, qlens)]
        pool, tables = make_pool(lens, Hkv, D, kv_dtype, torch.bfloat16, seed=10 + i)
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)
        q = torch.randn(starts[-1], H, D).bfloat16()
        sk = _sinks(sinks, H)
        out = poisoned(starts[-1], H, D, dtype=torch.bfloat16)
        paged_prefill(q, pool, tables, torch.tensor(lens, dtype=torch.int32),
                      torch.tensor(starts, dtype=torch.int32), D ** -0.5, window, sk,
                      out=out, config=cfg)
        ref = reference_paged_attention(q, pool, tables, starts, lens, D ** -0.5, window, sk)
        assert rel_err(out, ref) < TOL[torch.bfloat16], (ctx, qlens)


def test_paged_prefill_padded_grid():
    """The grid a captured prefill step uses: T padded past the last start, empty sequences
    (a graph's padded rows) between live ones, and a 1-token decode row. Live rows match
    the twin; rows past query_start[B] and the empty sequences write nothing."""
    H, Hkv, D = 4, 2, 32
    ctx, qlens = [0, 9, 0, 30, 0, 4], [0, 5, 0, 17, 0, 1]
    lens = [max(c + n, 1) for c, n in zip(ctx, qlens)]
    pool, tables = make_pool(lens, Hkv, D, torch.bfloat16, torch.bfloat16, seed=21)
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    live, pad = starts[-1], 11
    q = torch.randn(live + pad, H, D).bfloat16()
    out = poisoned(live + pad, H, D, dtype=torch.bfloat16)
    paged_prefill(q, pool, tables, torch.tensor(lens, dtype=torch.int32),
                  torch.tensor(starts, dtype=torch.int32), D ** -0.5, None, None, out=out,
                  config=dict(BM=16, BN=16))
    assert torch.isnan(out[live:].float()).all(), "rows past the last sequence were written"
    keep = [b for b, n in enumerate(qlens) if n]
    sub = [0]
    for b in keep:
        sub.append(sub[-1] + qlens[b])
    ref = reference_paged_attention(q[:live], pool, tables[keep], sub, [lens[b] for b in keep], D ** -0.5)
    assert rel_err(out[:live], ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_compute_dtypes(dtype):
    """float32 (the CPU engine's dtype) and fp16; head dim 24 is padded to 32."""
    H, Hkv, D = 4, 2, 24
    lens = [17, 40]
    pool, tables = make_pool(lens, Hkv, D, dtype, dtype, seed=3)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(2, H, D).to(dtype)
    out = poisoned(2, H, D, dtype=dtype)
    paged_decode(q, pool, tables, seq_lens, 0.2, None, None, out=out, num_splits=2, config=dict(BN=16))
    ref = reference_paged_attention(q, pool, tables, [0, 1, 2], lens, 0.2)
    assert rel_err(out, ref) < TOL[dtype]
    q = torch.randn(9, H, D).to(dtype)  # 4 new tokens of sequence 0, 5 of sequence 1
    out = poisoned(9, H, D, dtype=dtype)
    starts = [0, 4, 9]
    paged_prefill(q, pool, tables, seq_lens, torch.tensor(starts, dtype=torch.int32), 0.2, 7, None,
                  out=out, config=dict(BM=16, BN=16))
    assert rel_err(out, reference_paged_attention(q, pool, tables, starts, lens, 0.2, 7)) < TOL[dtype]


def test_fp8_word_tiles_match_elementwise_and_twin():
    """fp8 pools load K / V as int32 words (column order permuted, q and the output permuted
    the same way): head dim 40 (10 words, padded to 16) and 64, decode with splits and prefill,
    against the twin and the element-by-element path (config WORDS False). Small V values
    (scales near 1e-7) would underflow float16 without the per-tile scale normalisation."""
    for D, vmul in ((40, 1.0), (64, 1.0), (64, 3e-5)):
        H, Hkv = 6, 2
        lens = [70, 3, 129]
        pool, tables = make_pool(lens, Hkv, D, FP8, torch.bfloat16, seed=D)
        if vmul != 1.0:
            pool.v_scale.mul_(vmul)
        q = torch.randn(len(lens), H, D).bfloat16()
        assert fp8_words(q, pool)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        outs = []
        for words in (True, False):
            out = poisoned(len(lens), H, D, dtype=torch.bfloat16)
            paged_decode(q, pool, tables, seq_lens, D ** -0.5, None, None, out=out, num_splits=3,
                         config=dict(BN=16, WORDS=words))
            outs.append(out)
        ref = reference_paged_attention(q, pool, tables, [0, 1, 2, 3], lens, D ** -0.5)
        assert rel_err(outs[0], ref) < TOL[torch.bfloat16], D
        assert rel_err(outs[0], outs[1]) < TOL[torch.bfloat16], D
        starts = [0, 5, 6, 15]  # 5, 1 and 9 new tokens
        qp = torch.randn(starts[-1], H, D).bfloat16()
        out = poisoned(starts[-1], H, D, dtype=torch.bfloat16)
        paged_prefill(qp, pool, tables, seq_lens, torch.tensor(starts, dtype=torch.int32), D ** -0.5,
                      None, None, out=out, config=dict(BM=16, BN=16, WORDS=True))  # off by default in prefill
        assert rel_err(out, reference_paged_attention(qp, pool, tables, starts, lens, D ** -0.5)) < TOL[torch.bfloat16]


def test_fp8_words_admission():
    """Word tiles need a 16-bit q, whole words per head and word-aligned rows."""
    pool, _ = make_pool([5], 2, 64, FP8, torch.bfloat16, seed=0)
    assert fp8_words(torch.zeros(1, 4, 64, dtype=torch.bfloat16), pool)
    assert not fp8_words(torch.zeros(1, 4, 64), pool)  # float32 q: the IEEE path keeps its precision
    odd, _ = make_pool([5], 2, 42, FP8, torch.bfloat16, seed=0)
    assert not fp8_words(torch.zeros(1, 4, 42, dtype=torch.bfloat16), odd)
    shifted = KVPool(pool.k[:, :, 1:61], pool.v[:, :, 1:61], BS, pool.k_scale, pool.v_scale)  # rows start mid-word
    assert not fp8_words(torch.zeros(1, 4, 60, dtype=torch.bfloat16), shifted)
    bf16, _ = make_pool([5], 2, 64, torch.bfloat16, torch.bfloat16, seed=0)
    assert not fp8_words(torch.zeros(1, 4, 64, dtype=torch.bfloat16), bf16)


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte (sel >> 4 i) & 7 of {b, a}."""
    src = a | b << 32
    return sum(((src >> 8 * ((sel >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))


def test_e4m3_word_ptx_routes_bytes_in_order():
    """The word decode's PTX, read as written: each output register's low / high half gets
    byte j of the first / second word (output j), which is what _fp8_words' join and permute
    assume. The conversion itself (cvt.rn.f16x2.e4m3x2: low byte to the low half) runs on the
    GPU only: tests/gpu/test_attention_gpu.py checks the fp8 kernels against the twin."""
    import re
    text = str(_E4M3_F16_PTX.value if hasattr(_E4M3_F16_PTX, "value") else _E4M3_F16_PTX)
    sels = [int(m, 16) for m in re.findall(r"prmt\.b32 x, \$4, \$5, 0x([0-9a-f]+)", text)]
    cvts = re.findall(r"cvt\.rn\.f16x2\.e4m3x2 \$(\d), ([lh])", text)
    assert len(sels) == 2 and [int(o) for o, _ in cvts] == [0, 1, 2, 3]
    w0, w1 = 0x03020100, 0x13121110  # byte j of word i holds 0x10 i + j
    for (out, half), sel in zip(cvts, [sels[0]] * 2 + [sels[1]] * 2):
        x = _prmt(w0, w1, sel)
        pair = (x >> (16 if half == "h" else 0)) & 0xFFFF
        j = int(out)
        assert (pair & 0xFF, pair >> 8) == (j, 0x10 + j), (out, hex(pair))


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_kv_write_matches_paged_cache(kv):
    """The op's write and the cache's own update store the same values and scales."""
    assert KERNEL_FP8_MAX == FP8_MAX
    kv_dtype = FP8 if kv == "fp8" else torch.bfloat16
    cache = PagedKVCache(1, num_blocks=4, block_size=BS, dtype=kv_dtype, device="cpu")
    k, v = torch.randn(20, 2, 32).bfloat16(), torch.randn(20, 2, 32).bfloat16()
    slot = SeqSlots.build([2, 0], 0, 20, BS, "cpu")
    want_k, want_v = cache.update(0, slot, 0, k, v)
    pool = KVPool(*cache.layer_pool(0, k, v))
    for t in (pool.k, pool.v, pool.k_scale, pool.v_scale):
        if t is not None:
            t.fill_(float("nan"))
    attention_op.kv_write(k, v, pool, slot.write_rows)
    got_k, got_v = cache.update(0, SeqSlots.build([2, 0], 20, 0, BS, "cpu"), 20, k[:0], v[:0])
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


# -- routes ------------------------------------------------------------------------------------
def _call(decode: bool = True, dv: int = 32, q_dtype=torch.bfloat16) -> attention_op.AttentionCall:
    pool, tables = make_pool([17], 2, 32, torch.bfloat16, torch.bfloat16, seed=0)
    if dv != 32:
        pool.v = torch.zeros(pool.v.shape[0], 2, dv, dtype=torch.bfloat16)
    return attention_op.AttentionCall(torch.randn(1, 4, 32).to(q_dtype), pool, tables,
                                      torch.tensor([17], dtype=torch.int32), [0, 1], [16 if decode else 0],
                                      decode, 0.2, forced=True)


def test_route_admission_reasons():
    route = {r.name: r for r in routes.ops()["attention"].routes}
    assert route["triton_paged_decode"].admit(_call()) is None
    assert route["triton_paged"].admit(_call(decode=False)) is None
    assert "not a decode step" in route["triton_paged_decode"].admit(_call(decode=False))
    assert route["triton_paged"].admit(_call(dv=16)) == "MLA head dims differ"
    assert "queries are" in route["triton_paged_prefill"].admit(_call(q_dtype=torch.float64))
    unforced = _call()
    unforced.forced = False
    assert "TRITON_INTERPRET=1 and a forced route" in route["triton_paged"].admit(unforced)
    status = {name: r.status for name, r in route.items()}
    assert status == {"triton_paged_decode": routes.DEFAULT, "triton_paged_prefill": routes.DEFAULT,
                      "triton_paged": routes.OPT_IN, "torch": routes.DEFAULT}


def test_forcing_and_graph_safety(monkeypatch):
    monkeypatch.delenv("LOWBIT_ROUTE_ATTENTION", raising=False)
    assert attention_op.decode_graph_refusal() is None  # the DEFAULT decode route is graph-safe
    assert routes.select("attention", _call()).name == "torch"  # CPU, unforced: the reference
    monkeypatch.setenv("LOWBIT_ROUTE_ATTENTION", "torch")
    assert "not a graph-safe decode route" in attention_op.decode_graph_refusal()
    monkeypatch.setenv("LOWBIT_ROUTE_ATTENTION", "triton_paged")
    assert attention_op.decode_graph_refusal() is None
    monkeypatch.setenv("LOWBIT_ROUTE_ATTENTION", "triton_paged_prefill")
    assert "not a graph-safe decode route" in attention_op.decode_graph_refusal()
    monkeypatch.setenv("LOWBIT_ROUTE_ATTENTION", "triton_paged_decode")
    with pytest.raises(LowbitError, match="not a decode step"):
        attention_op.paged_attention(_call(decode=False))


def test_torch_route_equals_twin():
    call = _call(decode=False)
    call.q = torch.randn(17, 4, 32).bfloat16()
    call.query_start, call.context_lens = [0, 17], [0]
    out = attention_op._run_torch(call)
    ref = reference_paged_attention(call.q, call.pool, call.block_tables, [0, 17], [17], 0.2)
    assert torch.equal(out, ref)


# -- engine ------------------------------------------------------------------------------------
DEMO = Path(lowbit.__file__).parent / "demo_model"


@pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="the demo model is not installed")
def test_demo_greedy_same_with_triton_route(monkeypatch):
    """Chunked prefill (8-token steps) beside decode: MIXED, PREFILL and DECODE steps all run
    the forced route; greedy tokens equal the torch route's (float32 on the CPU)."""
    from lowbit import LLM, SamplingParams

    prompts = ["It is a truth", "HAMLET.\nTo be, or not"]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    monkeypatch.delenv("LOWBIT_ROUTE_ATTENTION", raising=False)
    llm = LLM("demo", kv_cache_tokens=256, max_num_batched_tokens=8)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    monkeypatch.setenv("LOWBIT_ROUTE_ATTENTION", "triton_paged")
    routes.reset_counters()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    ran = {c["route"] for c in routes.counters()["route_calls"] if c["op"] == "attention"}
    assert ran == {"triton_paged"}


def test_triton_routes_refuse_a_contiguous_call_and_torch_takes_it():
    """A call without a paged pool (the contiguous cache of model tests) is refused by every
    Triton route with its reason and served by the torch route's per-sequence loop."""
    route = {r.name: r for r in routes.ops()["attention"].routes}
    q = torch.randn(5, 4, 32)
    k, v = torch.randn(5, 2, 32), torch.randn(5, 2, 32)
    call = attention_op.AttentionCall(q, None, None, None, [0, 5], [0], False, 32 ** -0.5, k=k, v=v)
    call.forced = True
    for name in ("triton_paged_decode", "triton_paged_prefill", "triton_paged"):
        reason = route[name].admit(call)
        assert reason is not None and ("contiguous" in reason or "decode" in reason), (name, reason)
    out = attention_op._run_torch(call)
    from lowbit.kernels.attention import dense_attention
    torch.testing.assert_close(out, dense_attention(q, k, v, 0, 32 ** -0.5, None, None))
