"""Tensor and expert parallel logits equal the single-process model's, on 2 CPU processes
(gloo). One spawn runs every scenario; each test then checks its own.

Models: the shared tiny qwen3_moe; a qwen3_moe with 1 kv head (copied to both ranks), a
dense first layer, tied embeddings and an odd vocabulary (padded); a deepseek_v3 (MLA,
grouped sigmoid routing with score bias, a shared expert, a dense first layer); a gpt-oss
(biases everywhere, sinks, interleaved fused experts through the family's own loaders);
qwen3_moe / mixtral checkpoints in four third-party quantized layouts (fp8 blocks, nvfp4,
AWQ and GPTQ int4), loaded as QuantizedTensors and cut on block boundaries.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from lowbit.checkpoint.loader import allocate_empty, load_model
from lowbit.config import EngineConfig
from lowbit.distributed import ParallelLayout, engine_model, load_shard, shard_model
from lowbit.engine.batch import ForwardBatch
from lowbit.engine.kv_cache import ContiguousKVCache
from lowbit.engine.llm import LLM
from lowbit.errors import LowbitError
from lowbit.models.config import load_config

TOL = 1e-4
N_TOKENS, CHUNKS = 21, (8, 15)  # a prefill in three cached steps: prefill, chunked, decode-like
A2A, ALL_REDUCE = 0, 1 << 30  # expert_parallel.ALL_TO_ALL_MIN_TOKENS: force one path
SCENARIOS = [  # (model, tp, ep, all-to-all threshold)
    ("qwen3_moe", 2, 1, ALL_REDUCE),
    ("qwen3_moe", 1, 2, ALL_REDUCE),
    ("qwen3_moe", 1, 2, A2A),
    ("qwen3_moe", 2, 2, ALL_REDUCE),
    ("qwen3_moe_kv1", 2, 1, ALL_REDUCE),
    ("qwen3_moe_kv1", 2, 2, A2A),
    ("deepseek_v3", 2, 1, ALL_REDUCE),
    ("deepseek_v3", 1, 2, A2A),
    ("deepseek_v3", 2, 2, ALL_REDUCE),
    ("gpt_oss", 2, 1, ALL_REDUCE),
    ("gpt_oss", 2, 2, A2A),
    # third-party quantized checkpoints: QuantizedTensors cut in the stream, block-aligned
    ("deepseek-fp8", 2, 2, ALL_REDUCE),  # experts whole: 64-row halves would split 128-row blocks
    ("ct-nvfp4", 2, 2, ALL_REDUCE),
    ("awq", 2, 1, ALL_REDUCE),
    ("gptq", 1, 2, A2A),
]


def scenario_id(s: tuple) -> str:
    return f"{s[0]}-tp{s[1]}-ep{s[2]}-{'a2a' if s[3] == A2A else 'allreduce'}"


def logits_of(path, vocab: int, load=load_model) -> torch.Tensor:
    """float32 logits of a fixed prompt run as three cached steps (load: load_shard on a rank)."""
    ids = torch.randint(0, vocab, (N_TOKENS,), generator=torch.Generator().manual_seed(1))
    lm = load(path, dtype="float32").model
    cache = ContiguousKVCache(lm.config.num_layers, 1, N_TOKENS)
    bounds = [0, *CHUNKS, N_TOKENS]
    with torch.no_grad():
        return torch.cat([lm.compute_logits(lm(ids[a:b], ForwardBatch.build([b - a], [a], [0], cache)))
                          for a, b in zip(bounds, bounds[1:])])


# -- tiny checkpoints ------------------------------------------------------------------------
def _save(model, path, spread=None) -> None:
    with torch.no_grad():  # biases, sinks and norms away from their 0 / 1 init
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        if spread is not None:
            spread(model)
    model.float().save_pretrained(path)


def _kv1(path) -> int:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=131, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], tie_word_embeddings=True,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    _save(Qwen3MoeForCausalLM(cfg).eval(), path)
    return 131


def _deepseek(path) -> int:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=107, hidden_size=40, intermediate_size=36, moe_intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=18, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=7, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(0)

    def spread(m):
        m.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.tensor([-0.8, 0.4, -0.7, 0.5]))

    _save(DeepseekV3ForCausalLM(cfg).eval(), path, spread)
    return 107


def _gpt_oss(path) -> int:
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=103, hidden_size=44, intermediate_size=18, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=10, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, initializer_range=0.1, swiglu_limit=7.0)
    torch.manual_seed(0)
    _save(GptOssForCausalLM(cfg).eval(), path)
    return 103


def _third_party(layout: str, path) -> int:
    """A checkpoint packed by hand in a published quantized layout (see tests/checkpoint)."""
    from tests.checkpoint.test_thirdparty_load import (
        LAYOUTS,
        V,
        dense_rest,
        linear_shapes,
        qwen_config,
        write,
    )

    qc, pack, _, mixtral = LAYOUTS[layout]
    g = torch.Generator().manual_seed(0)
    tensors = dense_rest(mixtral, g)
    for key, shape in linear_shapes(mixtral).items():
        tensors.update({f"{key}{suffix}": t for suffix, t in pack(shape, g, key)[0].items()})
    write(path, {**qwen_config("mixtral" if mixtral else "qwen3_moe"), "quantization_config": qc}, tensors)
    return V


# -- the 2-process run ------------------------------------------------------------------------
def _worker(rank: int, port: int, models: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from lowbit.distributed import destroy_distributed, expert_parallel, init_distributed

    for s in SCENARIOS:
        name, tp, ep, threshold = s
        out = os.path.join(out_dir, f"{scenario_id(s)}.rank{rank}")
        try:
            init_distributed(tp, ep, "cpu")
            expert_parallel.ALL_TO_ALL_MIN_TOKENS = threshold
            save_file({"logits": logits_of(*models[name], load=load_shard).contiguous()}, out + ".safetensors")
        except Exception:
            with open(out + ".err", "w") as f:
                f.write(traceback.format_exc())
            raise
    destroy_distributed()


@pytest.fixture(scope="module")
def models(tiny_moe_dir, tmp_path_factory) -> dict:
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tiny_moe_dir / "tokenizer.json")).get_vocab_size()
    out = {"qwen3_moe": (str(tiny_moe_dir), vocab)}
    for name, make in (("qwen3_moe_kv1", _kv1), ("deepseek_v3", _deepseek), ("gpt_oss", _gpt_oss)):
        path = tmp_path_factory.mktemp(name)
        out[name] = (str(path), make(path))
    for layout in ("deepseek-fp8", "ct-nvfp4", "awq", "gptq"):
        path = tmp_path_factory.mktemp(layout)
        out[layout] = (str(path), _third_party(layout, path))
    return out


@pytest.fixture(scope="module")
def parallel_run(models, tmp_path_factory) -> str:
    out_dir = str(tmp_path_factory.mktemp("tp_ep"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(_worker, args=(port, models, out_dir), nprocs=2, start_method="spawn")
    except mp.ProcessRaisedException:
        pass  # each scenario's test reports its own error file
    return out_dir


@pytest.mark.parametrize("scenario", SCENARIOS, ids=scenario_id)
def test_parallel_logits_match_one_process(scenario, models, parallel_run):
    torch.set_num_threads(1)
    ref = logits_of(*models[scenario[0]])
    base = os.path.join(parallel_run, scenario_id(scenario))
    for rank in (0, 1):
        if os.path.exists(f"{base}.rank{rank}.err"):
            pytest.fail(open(f"{base}.rank{rank}.err").read())
        if not os.path.exists(f"{base}.rank{rank}.safetensors"):
            pytest.fail("the workers stopped at an earlier scenario's error")
        got = load_file(f"{base}.rank{rank}.safetensors")["logits"]
        assert got.shape == ref.shape
        err = (got - ref).abs().max().item()
        assert err < TOL, f"rank {rank}: max |logit diff| {err:.2e}"


# -- refusals (one process: sharding a meta model needs no process group) -----------------
@pytest.mark.parametrize("tp,message", [
    (4, r"model\.layers\.0\.self_attn \(query heads\): 6 heads do not split over 4 ranks"),
    (3, r"model\.layers\.0\.self_attn: 2 kv heads cannot be split over 3 ranks"),
])
def test_indivisible_heads_are_refused(models, tp, message):
    cfg = load_config(models["gpt_oss"][0])  # 6 query heads, 2 kv heads
    m = allocate_empty(cfg, torch.float32, "cpu")
    with pytest.raises(LowbitError, match=message):
        shard_model(m, ParallelLayout(tp=tp))


def test_indivisible_experts_are_refused(models):
    cfg = load_config(models["deepseek_v3"][0])  # 4 experts
    m = allocate_empty(cfg, torch.float32, "cpu")
    with pytest.raises(LowbitError, match=r"model\.layers\.1\.mlp\.experts: 4 experts do not split over 3"):
        shard_model(m, ParallelLayout(tp=1, ep=3))


def test_engine_refuses_parallel_sizes_it_was_not_launched_with():
    with pytest.raises(LowbitError, match=r"needs one process per GPU: `lowbit generate` starts them"):
        engine_model(EngineConfig(expert_parallel_size=2))
    with pytest.raises(LowbitError, match=r"needs one process per GPU: `lowbit generate` starts them"):
        LLM("demo", expert_parallel_size=2)  # an engine loading its own model is one process


def test_loading_a_shard_needs_a_rank():
    with pytest.raises(LowbitError, match="call lowbit.distributed.init_distributed first"):
        load_shard("demo")


def test_world_size_must_match_the_layout():
    with pytest.raises(LowbitError, match=r"lcm\(2, 4\) = 4 processes, but WORLD_SIZE is 2"):
        ParallelLayout.checked(2, 4, world=2)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
