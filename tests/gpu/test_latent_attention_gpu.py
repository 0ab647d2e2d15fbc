"""MLA on the GPU: the latent decode and prefill kernels at DeepSeek sizes against their
twin, replayed from a CUDA graph at other lengths, and a small random DeepSeek model in the
engine with decode and prefill graphs on: captured, no host sync inside a decode step, the
same greedy tokens as eager.

Sizes: C = 512, Dr = 64 (DeepSeek-V2-Lite and V3), H = 16 (V2-Lite) and 128 (V3), B up to
8, contexts up to 32K. Pools hold random data, blocks are handed out shuffled, outputs are
poisoned with NaN. Tolerance: the twin computes in float32 from the stored values; the
kernel rounds P to bf16 before the PV product: rel 1e-2 (typically a few 1e-3).
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

BS = 16
RTOL = 1e-2
C, DR = 512, 64


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _latent_pool(seq_lens: list[int], fp8: bool, seed: int, spare_blocks: int = 1):
    """A NaN-poisoned one-head pool (c_kv [R, 1, C], k_pe [R, 1, Dr]) with each sequence's
    tokens written through the KV-write twin; tables padded with a spare block."""
    from lowbit.kernels.attention import FP8, KVPool, reference_kv_write

    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-n // BS) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    rows = (num_blocks + 1) * BS
    dt = FP8 if fp8 else torch.bfloat16

    def nan(*shape, dtype):
        return torch.full(shape, float("nan"), dtype=dtype, device="cuda")

    pool = KVPool(nan(rows, 1, C, dtype=dt), nan(rows, 1, DR, dtype=dt), BS,
                  nan(rows, 1, dtype=torch.float32) if fp8 else None,
                  nan(rows, 1, dtype=torch.float32) if fp8 else None)
    order = torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32)
    tables = torch.full((len(seq_lens), max(need) + spare_blocks), num_blocks, dtype=torch.int32, device="cuda")
    first = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[first:first + n]
        first += n
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n, device="cuda")
        slots = tables[b][pos // BS].long() * BS + pos % BS
        reference_kv_write(torch.randn(n, 1, C, generator=g, device="cuda").bfloat16(),
                           torch.randn(n, 1, DR, generator=g, device="cuda").bfloat16(), pool, slots)
    return pool, tables


def _queries(B: int, H: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(B, H, C, generator=g, device="cuda").bfloat16(),
            torch.randn(B, H, DR, generator=g, device="cuda").bfloat16())


CASES = [  # (seq_lens, H, fp8)
    ([32768], 16, False),
    ([32768], 128, False),
    ([32768], 16, True),
    ([8192, 1, 4097, 8000, 17, 6000, 8191, 300], 16, False),
    ([8192, 1, 4097, 8000, 17, 6000, 8191, 300], 128, True),
    ([2048 - 7 * i for i in range(8)], 128, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{len(c[0])}-max{max(c[0])}-H{c[1]}-fp8{c[2]}")
def test_latent_decode_real_sizes(case):
    from lowbit.kernels.latent import latent_decode, reference_latent_decode

    lens, H, fp8 = case
    pool, tables = _latent_pool(lens, fp8, seed=len(lens))
    q_lat, q_pe = _queries(len(lens), H, seed=H)
    out = torch.full_like(q_lat, float("nan"))
    scale = (128 + DR) ** -0.5
    latent_decode(q_lat, q_pe, pool, tables, torch.tensor(lens, dtype=torch.int32, device="cuda"), scale, out=out)
    ref = reference_latent_decode(q_lat, q_pe, pool, tables, lens, scale)
    assert _rel(out, ref) < RTOL


def test_latent_decode_replays_from_a_graph_at_other_lengths():
    """Captured once at some lengths, replayed after the lengths (device tensor) changed:
    the replay follows the device values, as the decode graph needs."""
    from lowbit.kernels.latent import latent_decode, reference_latent_decode

    full = [3000, 700, 64]
    pool, tables = _latent_pool(full, False, seed=3)
    q_lat, q_pe = _queries(3, 16, seed=4)
    seq_lens = torch.tensor([10, 1, 5], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q_lat)
    latent_decode(q_lat, q_pe, pool, tables, seq_lens, 0.1, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        latent_decode(q_lat, q_pe, pool, tables, seq_lens, 0.1, out=out)
    for lens in ([10, 1, 5], [3000, 700, 64], [1234, 17, 33]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        assert _rel(out, reference_latent_decode(q_lat, q_pe, pool, tables, lens, 0.1)) < RTOL, lens


@pytest.mark.parametrize("case", [([32768], 16, False), ([8192, 1, 4097, 8000, 17, 6000, 8191, 300], 16, True),
                                  ([2048 - 7 * i for i in range(16)], 128, False)],
                         ids=lambda c: f"B{len(c[0])}-max{max(c[0])}-H{c[1]}-fp8{c[2]}")
def test_latent_decode_with_w_uv_real_sizes(case):
    """The reduce launch with W_UV (Dv = 128, a strided view of kv_b_proj's [H, 256, C]
    whose W_UK rows are NaN) against the twin's context times W_UV, float32."""
    from lowbit.kernels.latent import latent_decode, reference_latent_decode

    lens, H, fp8 = case
    pool, tables = _latent_pool(lens, fp8, seed=len(lens) + 1)
    q_lat, q_pe = _queries(len(lens), H, seed=H + 1)
    w = torch.full((H, 256, C), float("nan"), dtype=torch.bfloat16, device="cuda")
    w[:, 128:] = (torch.randn(H, 128, C, device="cuda") * 0.05).bfloat16()
    out = torch.full((len(lens), H, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    scale = (128 + DR) ** -0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    latent_decode(q_lat, q_pe, pool, tables, seq_lens, scale, out=out, w_uv=w[:, 128:], num_splits=32)
    ctx = reference_latent_decode(q_lat, q_pe, pool, tables, lens, scale)
    assert _rel(out, torch.einsum("bhc,hvc->bhv", ctx.float(), w[:, 128:].float())) < RTOL


PREFILL_CASES = [  # (seq_lens, new tokens, H, fp8): prompts, chunks over cached prefixes, decodes
    ([2048], [2048], 16, False),
    ([3000, 700, 64, 9], [512, 100, 64, 1], 128, False),
    ([3000, 700, 64, 9], [512, 100, 64, 1], 16, True),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"T{sum(c[1])}-H{c[2]}-fp8{c[3]}")
def test_latent_prefill_real_sizes(case):
    """One query per token over its causal prefix, the sequence of each token and its length
    found on the device, against the twin run per token; then the same call replayed from a
    CUDA graph after the lengths changed."""
    from lowbit.kernels.latent import latent_prefill, reference_latent_decode

    lens, news, H, fp8 = case
    pool, tables = _latent_pool(lens, fp8, seed=sum(news))
    T = sum(news)
    q_lat, q_pe = _queries(T, H, seed=H + 1)
    starts = torch.tensor([0] + news, device="cuda").cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = (128 + DR) ** -0.5
    out = torch.full_like(q_lat, float("nan"))
    latent_prefill(q_lat, q_pe, pool, tables, seq_lens, starts, scale, out=out)
    rows = [b for b, n in enumerate(news) for _ in range(n)]
    pos = [lens[b] - news[b] + j for b, n in enumerate(news) for j in range(n)]
    ref = reference_latent_decode(q_lat, q_pe, pool, tables[rows], [p + 1 for p in pos], scale)
    assert _rel(out, ref) < RTOL
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        latent_prefill(q_lat, q_pe, pool, tables, seq_lens, starts, scale, out=out)
    shorter = [n - 1 if n > news[b] else n for b, n in enumerate(lens)]  # one cached token fewer
    seq_lens.copy_(torch.tensor(shorter, dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    pos = [shorter[b] - news[b] + j for b, n in enumerate(news) for j in range(n)]
    ref = reference_latent_decode(q_lat, q_pe, pool, tables[rows], [p + 1 for p in pos], scale)
    assert _rel(out, ref) < RTOL


# -- the engine ------------------------------------------------------------------------------
def _deepseek_dir(path, version: str):
    """A small random DeepSeek HF directory at the real attention shape (C = 512, Dr = 64),
    weights large enough that greedy text varies: V2 (softmax routing, no q LoRA) with 16
    heads, or V3 (grouped sigmoid routing, q LoRA) with 32 heads (two head blocks)."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
    )

    from tests.engine.tiny_model import EOS_ID, build_tokenizer
    from tests.models.parity import save_tiny

    path.mkdir(parents=True, exist_ok=True)
    common = dict(vocab_size=build_tokenizer(path), hidden_size=256, intermediate_size=256,
                  moe_intermediate_size=64, num_hidden_layers=2, kv_lora_rank=C, qk_rope_head_dim=DR,
                  qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
                  n_shared_experts=2, first_k_dense_replace=1, max_position_embeddings=4096,
                  bos_token_id=EOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False,
                  initializer_range=0.1, experts_implementation="eager")
    if version == "v2":
        cls, cfg = DeepseekV2ForCausalLM, DeepseekV2Config(
            num_attention_heads=16, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1,
            norm_topk_prob=False, **common)
    else:
        cls, cfg = DeepseekV3ForCausalLM, DeepseekV3Config(
            num_attention_heads=32, num_key_value_heads=32, q_lora_rank=128, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, **common)
    save_tiny(cls, cfg, path)
    return str(path)


def _engine(path: str, **kw):
    from lowbit.config import EngineConfig
    from lowbit.engine.engine import LLMEngine

    cfg = dict(model=path, device="cuda", dtype="bfloat16",
               kv_cache_tokens=8192, max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=64)
    return LLMEngine(EngineConfig(**{**cfg, **kw}))


VERSIONS = ["v2", "v3"]


@pytest.mark.parametrize("version", VERSIONS)
def test_deepseek_engine_graph_tokens_equal_eager(tmp_path, version):
    """Four requests (bucket 4, no padding; max_model_len 64: one split, so eager and replay
    launch the same kernels) decode from graphs with no host sync inside a step, on the
    latent route, and give the eager engine's greedy tokens."""
    from lowbit import SamplingParams
    from lowbit.kernels import routes

    path = _deepseek_dir(tmp_path / "m", version)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 17, 30)]
    outs = {}
    for eager in (False, True):
        engine = _engine(path, enforce_eager=eager)
        assert (engine.runner.graphs is None) == eager, engine.runner.graphs_off
        reqs = [engine.add_request(p, sp) for p in prompts]
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
            engine.step()
        engine.step()  # the first decode step (captures the bucket when graphs are on)
        routes.reset_counters()
        torch.cuda.set_sync_debug_mode(0 if eager else "error")  # replays never wait on the GPU
        try:
            for _ in range(4):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        while engine.has_unfinished():
            engine.step()
        outs[eager] = [r.output_token_ids for r in reqs]
        if not eager:
            graphs = engine.runner.graphs
            assert graphs.graphs and not graphs.eager, graphs.eager
            assert {b for b, _ in graphs.graphs} == {4}
        else:
            ran = {c["route"] for c in routes.counters()["route_calls"] if c["op"] == "latent_attention"}
            assert ran == {"triton_latent_decode"}
    assert outs[False] == outs[True]


def replayed_and_eager_step(engine, bucket: int | None = None):
    """Three sequences (700, 37 and 5 prompt tokens) decoded for 20 engine steps, then one
    decode step replayed from its graph and the same step run eagerly: (graph tokens, graph
    logits, eager logits, the (op, route) pairs the eager step called)."""
    from lowbit import SamplingParams
    from lowbit.kernels import routes

    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    reqs = [engine.add_request(torch.randint(0, 256, (n,), generator=g).tolist(), sp) for n in (700, 37, 5)]
    for _ in range(20):
        engine.step()
    assert engine.runner.graphs.graphs, "no decode step replayed a graph"
    assert all(r.num_computed_tokens > r.num_prompt_tokens for r in reqs)
    sched = engine.scheduler.schedule()
    runner = engine.runner
    with torch.inference_mode():
        ids, batch = runner.prepare(sched.scheduled)
        mode = runner.sampling.mode_for([r.params for r, _ in sched.scheduled])
        assert batch.mode.is_decode and runner.graphs.ready(batch.num_seqs, mode)
        if bucket is not None:
            assert runner.graphs.bucket_for(batch.num_seqs) == bucket
        tokens, logits = runner.graphs.run(batch.num_seqs, mode)
        tokens, logits = tokens.clone(), logits.clone()
        routes.reset_counters()
        eager = engine.model.compute_logits(engine.model(ids, batch))  # rewrites the same latent rows
    ran = {(c["op"], c["route"]) for c in routes.counters()["route_calls"]}
    return tokens, logits, eager, ran


def test_deepseek_graph_replay_matches_eager_with_splits(tmp_path):
    """Three sequences (bucket 4: one padded row) with a 2048-token context window, so the
    graph's static table width gives several splits: one decode step replayed from its graph
    gives the logits and greedy tokens of the same step run eagerly."""
    engine = _engine(_deepseek_dir(tmp_path / "m", "v2"), max_model_len=2048)
    tokens, logits, eager, _ = replayed_and_eager_step(engine, bucket=4)
    assert _rel(logits, eager) < RTOL
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("version", VERSIONS)
def test_deepseek_prefill_graphs_give_the_eager_tokens(tmp_path, version):
    """Prompts arriving two steps apart (so chunks run beside decodes) through captured
    prefill and mixed steps on the latent prefill route give the tokens of the same engine
    with prefill graphs off."""
    from lowbit import SamplingParams
    from lowbit.kernels import routes

    path = _deepseek_dir(tmp_path / "m", version)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 300, 17, 900, 40)]
    outs = {}
    for on in (True, False):
        engine = _engine(path, prefill_graphs=on, max_model_len=2048, max_num_batched_tokens=512)
        assert (engine.runner.prefill_graphs is not None) == on, engine.runner.prefill_graphs_off
        routes.reset_counters()
        reqs, pending = [], list(prompts)
        while pending or engine.has_unfinished():
            if pending:
                reqs.append(engine.add_request(pending.pop(0), sp))
            for _ in range(2):
                if engine.has_unfinished():
                    engine.step()
        outs[on] = [r.output_token_ids for r in reqs]
        if on:
            pg = engine.runner.prefill_graphs
            assert not pg.eager and pg.replays > 0, pg.status()
        else:
            ran = {c["route"] for c in routes.counters()["route_calls"] if c["op"] == "latent_attention"}
            assert "triton_latent_prefill" in ran and "torch" not in ran, ran
    assert outs[True] == outs[False]
