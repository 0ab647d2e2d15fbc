import pytest
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tests.models.parity import assert_bf16_parity, assert_parity, save_tiny


def test_qwen3_dense_matches_transformers(tmp_path):
    cfg = Qwen3Config(vocab_size=131, hidden_size=48, intermediate_size=88, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=12, rope_theta=1e4,
                      tie_word_embeddings=False)
    hf = save_tiny(Qwen3ForCausalLM, cfg, tmp_path)
    assert_parity(hf, tmp_path, 131)
    assert_bf16_parity(hf, tmp_path, 131)


@pytest.mark.parametrize("sparse_step,mlp_only", [(1, []), (2, [0])])
def test_qwen3_moe_matches_transformers(tmp_path, sparse_step, mlp_only):
    cfg = Qwen3MoeConfig(vocab_size=127, hidden_size=40, intermediate_size=72, moe_intermediate_size=24,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                         num_experts=5, num_experts_per_tok=2, norm_topk_prob=sparse_step == 1,
                         decoder_sparse_step=sparse_step, mlp_only_layers=mlp_only, tie_word_embeddings=True)
    hf = save_tiny(Qwen3MoeForCausalLM, cfg, tmp_path)
    assert_parity(hf, tmp_path, 127)
    assert_bf16_parity(hf, tmp_path, 127)


def test_every_hot_op_of_a_layer_is_a_counted_door_call(tiny_moe_dir):
    """A qwen3_moe forward over a contiguous batch (no paged pool) still reaches every op
    through the registry: the attention op's torch route takes the contiguous call."""
    import torch

    from lowbit.checkpoint.loader import load_model
    from lowbit.engine.batch import ForwardBatch
    from lowbit.kernels import routes

    lm = load_model(str(tiny_moe_dir), dtype="float32", device="cpu").model
    routes.reset_counters()
    with torch.inference_mode():
        lm(torch.tensor([4, 8, 15, 16, 23]), ForwardBatch.build([5], [0], None))
    calls = {(c["op"], c["route"]) for c in routes.counters()["route_calls"]}
    for op in ("attention", "norm", "rope", "router", "moe", "linear"):
        assert any(o == op for o, _ in calls), f"{op} made no counted call: {sorted(calls)}"
