"""A tiny random qwen3_moe in an HF directory, with a byte-level tokenizer built in place.

The tokenizer has one token per byte (no merges) plus three special tokens, so it needs no
training and is the same on every run; the model is transformers' Qwen3MoeForCausalLM
with seeded random weights, saved as safetensors. Its output head only has weight on
printable ASCII bytes, so greedy text is readable and stop strings can be picked from it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 256  # <|endoftext|>
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
MAX_POSITIONS = 256


def build_tokenizer(path: Path) -> int:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": SPECIALS[0], "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": SPECIALS[1:]}))
    return tok.get_vocab_size()


def _bytes_to_unicode() -> list[str]:
    """The byte -> printable character map of byte-level BPE (GPT-2's convention)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def make_tiny_model(path: Path, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(path)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=MAX_POSITIONS,
                         bos_token_id=EOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False,
                         initializer_range=0.2)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval().float()
    with torch.no_grad():
        printable = torch.zeros(vocab, dtype=torch.bool)
        printable[ord(" "):ord("~") + 1] = True
        model.lm_head.weight[~printable] = 0.0
        model.lm_head.weight[printable] *= 4.0
    model.save_pretrained(path)
    return path
