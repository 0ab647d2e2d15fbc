"""Train the demo model's byte-level BPE tokenizer on the train split of the demo corpus.

Writes tokenizer.json and tokenizer_config.json (with the chat template) into --out.
    python scripts/demo/train_tokenizer.py --corpus data/demo_corpus --out lowbit/demo_model
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]  # ids 0, 1, 2

# One turn per message; an assistant prompt is opened when asked for.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(documents: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def tokenizer_config(max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=Path("data/demo_corpus"))
    parser.add_argument("--out", type=Path, default=Path("lowbit/demo_model"))
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--max-length", type=int, default=2048)
    args = parser.parse_args()

    documents = (args.corpus / "train.txt").read_text(encoding="utf-8").split(EOT)
    tok = build_tokenizer(documents, args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    config = tokenizer_config(args.max_length)
    (args.out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    sample = documents[0][:2000]
    ids = tok.encode(sample).ids
    assert tok.decode(ids) == sample, "byte-level BPE must round-trip"
    print(f"vocab {tok.get_vocab_size()}, {len(sample) / len(ids):.2f} chars/token on a sample")


if __name__ == "__main__":
    main()
