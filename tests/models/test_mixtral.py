import pytest
from transformers import MixtralConfig, MixtralForCausalLM

from tests.models.parity import assert_parity, save_tiny


@pytest.mark.parametrize("window", [None, 5])
def test_mixtral_matches_transformers(tmp_path, window):
    cfg = MixtralConfig(vocab_size=113, hidden_size=36, intermediate_size=20, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=3, num_local_experts=6,
                        num_experts_per_tok=2, sliding_window=window, max_position_embeddings=64)
    hf = save_tiny(MixtralForCausalLM, cfg, tmp_path)
    assert_parity(hf, tmp_path, 113)
