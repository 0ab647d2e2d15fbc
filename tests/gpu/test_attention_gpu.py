"""Paged attention on the GPU at real sizes against the torch twins, and a decode step of a
small random qwen3_moe replayed from a CUDA graph against the same step run eagerly.

Sizes: Qwen3-30B-A3B heads (H/Hkv = 32/4, D = 128) at B up to 32 and contexts up to 32K;
gpt-oss-like heads (64/8, D = 64) with a window and sinks. Pools hold random data (never
zeros), blocks are handed out shuffled, outputs are poisoned with NaN. Tolerance: the twin
computes in float32 from the stored values; the kernels round P to bf16 before the PV
product: rel 1e-2 (typically a few 1e-3).
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


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _pool(seq_lens: list[int], hkv: int, d: int, fp8: bool, seed: int):
    """A NaN-poisoned pool with each sequence's tokens written through the KV-write op."""
    from lowbit.kernels.attention import FP8, KVPool, reference_kv_write

    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-n // BS) for n in seq_lens]
    num_blocks = sum(need) + 1
    rows = (num_blocks + 1) * BS
    dt = FP8 if fp8 else torch.bfloat16

    def nan(*shape, dtype):
        return torch.full(shape, float("nan"), dtype=dtype, device="cuda")

    pool = KVPool(nan(rows, hkv, d, dtype=dt), nan(rows, hkv, d, dtype=dt), BS,
                  nan(rows, hkv, dtype=torch.float32) if fp8 else None,
                  nan(rows, hkv, dtype=torch.float32) if fp8 else None)
    order = torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32)
    tables = torch.full((len(seq_lens), max(need)), num_blocks, dtype=torch.int32, device="cuda")
    first = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[first:first + n]
        first += n
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n, device="cuda")
        slots = tables[b][pos // BS].long() * BS + pos % BS
        k = torch.randn(n, hkv, d, generator=g, device="cuda").bfloat16()
        v = torch.randn(n, hkv, d, generator=g, device="cuda").bfloat16()
        reference_kv_write(k, v, pool, slots)
    return pool, tables


DECODE_CASES = [  # (seq_lens, H, Hkv, D, window, sinks, fp8)
    ([32768], 32, 4, 128, None, False, False),
    ([32768], 32, 4, 128, None, False, True),
    ([8192, 1, 4097, 8000, 17, 6000, 8191, 300], 32, 4, 128, None, False, False),
    ([2048 - 7 * i for i in range(32)], 32, 4, 128, None, False, False),
    ([5000, 130, 1], 64, 8, 64, 128, True, False),
]


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"B{len(c[0])}-max{max(c[0])}-H{c[1]}")
def test_paged_decode_real_sizes(case, fold):
    """fold: the last split of each kv head merges (twice in a row: its counters reset)."""
    from lowbit.kernels.attention import paged_decode, reference_paged_attention

    lens, H, Hkv, D, window, sinks, fp8 = case
    pool, tables = _pool(lens, Hkv, D, fp8, seed=len(lens))
    sk = torch.randn(H, device="cuda") if sinks else None
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for _ in range(2 if fold else 1):
        q = torch.randn(len(lens), H, D, device="cuda").bfloat16()
        out = torch.full_like(q, float("nan"))
        paged_decode(q, pool, tables, seq_lens, D ** -0.5, window, sk, out=out, config=dict(FOLD=fold))
        ref = reference_paged_attention(q, pool, tables, list(range(len(lens) + 1)), lens, D ** -0.5,
                                        window, sk)
        assert _rel(out, ref) < RTOL


PREFILL_CASES = [  # (cached, new, H, Hkv, D, window, sinks, fp8)
    ([0, 3000, 100, 8000], [1000, 500, 1, 37], 32, 4, 128, None, False, False),
    ([0, 3000, 100, 8000], [1000, 500, 1, 37], 32, 4, 128, None, False, True),
    ([0, 700], [600, 129], 64, 8, 64, 128, True, False),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"H{c[2]}-fp8{c[7]}-win{c[5]}")
def test_paged_prefill_real_sizes(case):
    from lowbit.kernels.attention import paged_prefill, reference_paged_attention

    ctx, new, H, Hkv, D, window, sinks, fp8 = case
    lens = [c + n for c, n in zip(ctx, new)]
    pool, tables = _pool(lens, Hkv, D, fp8, seed=7)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], H, D, device="cuda").bfloat16()
    sk = torch.randn(H, device="cuda") if sinks else None
    out = torch.full_like(q, float("nan"))
    paged_prefill(q, pool, tables, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                  torch.tensor(starts, dtype=torch.int32, device="cuda"), D ** -0.5, window,
                  sk, out=out)
    ref = reference_paged_attention(q, pool, tables, starts, lens, D ** -0.5, window, sk)
    assert _rel(out, ref) < RTOL


def _moe_dir(path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.engine.tiny_model import EOS_ID, build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(path)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
                         bos_token_id=EOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).eval().to(torch.bfloat16).save_pretrained(path)
    return path


def test_decode_graph_replay_matches_eager(tmp_path, caplog):
    """Prompts of 5, 37 and 100 tokens prefill in 16-token chunks beside decodes (the prefill
    kernel over cached prefixes), then decode through graphs (bucket 4: one padded row) across
    block boundaries, all on the default routes; the logits and greedy tokens of one decode
    step replayed from its graph (ids -> sampled tokens) equal the same step run eagerly."""
    from lowbit import SamplingParams
    from lowbit.config import EngineConfig
    from lowbit.engine.engine import LLMEngine

    caplog.set_level("INFO", logger="lowbit")
    engine = LLMEngine(EngineConfig(model=str(_moe_dir(tmp_path / "moe")), device="cuda", dtype="bfloat16",
                                    kv_cache_tokens=4096, max_num_seqs=8, max_num_batched_tokens=16,
                                    max_model_len=512))
    assert engine.runner.graphs is not None, f"decode graphs were not captured: {caplog.text}"
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    reqs = [engine.add_request(torch.randint(32, 127, (n,), generator=g).tolist(), sp) for n in (5, 37, 100)]
    for _ in range(60):
        if all(r.num_computed_tokens > r.num_prompt_tokens + 12 for r in reqs):
            break
        engine.step()
    assert all(r.num_computed_tokens > r.num_prompt_tokens + 12 for r in reqs)
    assert engine.runner.graphs.graphs, "no decode step replayed a graph"
    sched = engine.scheduler.schedule()
    runner = engine.runner
    with torch.inference_mode():
        ids, batch = runner.prepare(sched.scheduled)
        mode = runner.sampling.mode_for([r.params for r, _ in sched.scheduled])
        assert batch.mode.is_decode and runner.graphs.bucket_for(batch.num_seqs) == 4
        assert runner.graphs.ready(batch.num_seqs, mode)
        tokens, logits = runner.graphs.run(batch.num_seqs, mode)
        tokens, logits = tokens.clone(), logits.clone()
        eager = engine.model.compute_logits(engine.model(ids, batch))  # rewrites the same K/V rows
    assert _rel(logits, eager) < RTOL
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("norm", [False, True])
def test_fp8_pool_write_of_the_rope_kernel_is_the_twins(monkeypatch, norm):
    """The fused q/k norm + RoPE + KV write into an fp8 pool at Qwen3-30B-A3B heads, 300
    tokens: the codes (the store's own round-to-nearest-even, no float32 emulation on the
    GPU) and the per-token-per-head scales are byte for byte reference_kv_write's from the
    same k, v; rows no slot names keep their NaN."""
    from lowbit.kernels.attention import FP8, KVPool, reference_kv_write
    from lowbit.kernels.rope_op import RopeCall, qk_norm_rope, rope_cos_sin
    from lowbit.layers.rope import RotaryEmbedding

    T, H, Hkv, D, rows = 300, 32, 4, 128, 512
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = (torch.randn(T, (H + 2 * Hkv) * D, generator=g, device="cuda") * 3).bfloat16()
    rot = RotaryEmbedding(D, 1e6, 4096, None)
    cos_sin = rope_cos_sin(rot.inv_freq, rot.attention_scaling, 4096).cuda()
    positions = torch.randint(0, 4096, (T,), generator=g, device="cuda")
    qw = kw = (1 + 0.2 * torch.randn(D, generator=g, device="cuda")).bfloat16() if norm else None

    def pool():
        nan8 = lambda: torch.full((rows, Hkv, D), float("nan")).to(FP8).cuda()
        return KVPool(nan8(), nan8(), BS, torch.full((rows, Hkv), float("nan"), device="cuda"),
                      torch.full((rows, Hkv), float("nan"), device="cuda"))

    slots = torch.randperm(rows, generator=g, device="cuda")[:T]
    got = pool()
    monkeypatch.setenv("LOWBIT_ROUTE_ROPE", "triton_qk_norm_rope")
    _, k, v = qk_norm_rope(RopeCall(qkv, H, Hkv, D, positions, cos_sin, qw, kw, 1e-6, got, slots), layer="t")
    want = pool()
    reference_kv_write(k, v, want, slots)
    for a, b in ((got.k, want.k), (got.v, want.v)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in ((got.k_scale, want.k_scale), (got.v_scale, want.v_scale)):
        assert torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0))
