"""Shared fixtures: a tiny random qwen3_moe HF directory with a real BPE tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife. In the beginning was the Word. ") * 20


def write_tokenizer(path, vocab: int = 200) -> None:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": template}))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models' ops are microseconds long: one thread beats two fighting over the
    cores (on a busy machine, by 40x). Folders whose tests run tiny models use it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = tmp_path_factory.mktemp("tiny_moe")
    write_tokenizer(path)
    vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                         eos_token_id=2)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).eval().to(torch.bfloat16).save_pretrained(path)
    return path
