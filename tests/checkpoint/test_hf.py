import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from lowbit.checkpoint.hf import CheckpointReader, read_generation_config, resolve_model_dir
from lowbit.checkpoint.loader import load_model
from lowbit.errors import LowbitError
from tests.models.parity import hf_logits, lowbit_logits


def tiny_moe(tmp_path, **save_kw):
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    m = Qwen3MoeForCausalLM(cfg).eval()
    m.save_pretrained(tmp_path, **save_kw)
    return m


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    hf = tiny_moe(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) >= 2
    ids = torch.arange(11) % 64
    assert torch.allclose(lowbit_logits(tmp_path, ids), hf_logits(hf, ids), atol=2e-4)


def test_reader_is_lazy_and_names_tensors(tmp_path):
    tiny_moe(tmp_path)
    r = CheckpointReader(tmp_path)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in r
    assert r.get("model.norm.weight").shape == (16,)
    with pytest.raises(LowbitError, match="not in the checkpoint"):
        r.get("model.nope")


def _rewrite(tmp_path, edit):
    tensors = dict(CheckpointReader(tmp_path).tensors())
    edit(tensors)
    (tmp_path / "model.safetensors").unlink()
    save_file(tensors, tmp_path / "model.safetensors")


def test_missing_tensor_named(tmp_path):
    tiny_moe(tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(LowbitError, match="layers.1.self_attn.k_norm.weight"):
        load_model(tmp_path, dtype="float32")


def test_extra_tensor_named(tmp_path):
    tiny_moe(tmp_path)
    _rewrite(tmp_path, lambda t: t.__setitem__("model.layers.0.bogus.weight", torch.zeros(2)))
    with pytest.raises(LowbitError, match="model.layers.0.bogus.weight"):
        load_model(tmp_path, dtype="float32")


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    tiny_moe(tmp_path)
    _rewrite(tmp_path, lambda t: t.__setitem__("model.layers.0.mlp.experts.2.up_proj.weight", torch.zeros(9, 16)))
    with pytest.raises(LowbitError, match=r"experts.2.up_proj.weight.*\(9, 16\).*\(8, 16\)"):
        load_model(tmp_path, dtype="float32")


def test_pickle_checkpoint_refused(tmp_path):
    tiny_moe(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(LowbitError, match="safetensors only"):
        load_model(tmp_path)


def test_bad_configs(tmp_path):
    with pytest.raises(LowbitError, match="neither a built-in name"):
        resolve_model_dir(tmp_path / "absent")
    tiny_moe(tmp_path)
    cfg = tmp_path / "config.json"
    raw = json.loads(cfg.read_text())
    cfg.write_text("{not json")
    with pytest.raises(LowbitError, match="not valid JSON"):
        load_model(tmp_path)
    cfg.write_text(json.dumps({**raw, "model_type": "llama9"}))
    with pytest.raises(LowbitError, match="unknown architecture"):
        load_model(tmp_path)
    raw.pop("hidden_size")
    cfg.write_text(json.dumps(raw))
    with pytest.raises(LowbitError, match="hidden_size"):
        load_model(tmp_path)


def test_generation_config_eos_list(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    assert read_generation_config(tmp_path)["eos_token_id"] == [3, 7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert read_generation_config(tmp_path)["eos_token_id"] == [5]
