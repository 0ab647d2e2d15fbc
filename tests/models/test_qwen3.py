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
