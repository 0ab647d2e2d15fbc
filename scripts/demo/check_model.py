"""Check the shipped demo model with Hugging Face transformers, on the CPU.

Loads lowbit/demo_model with AutoModelForCausalLM (fails on any missing or unexpected key),
checks the checkpoint layout and size, scores the held-out split when the corpus is present,
and prints a greedy, a sampled and a chat completion.
    python scripts/demo/check_model.py
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parent))
import train  # noqa: E402  (same folder: encode_documents, heldout_loss)

SIZE_LIMIT = 25_000_000


def check_layout(model_dir: Path) -> None:
    size = sum(p.stat().st_size for p in model_dir.iterdir())
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    fused = [k for k in keys if k.endswith(("gate_up_proj", "experts.down_proj"))]
    print(f"{len(keys)} tensors, dtypes {sorted(dtypes)}, directory {size:,} bytes")
    assert not fused, f"fused expert tensors in the checkpoint: {fused[:2]}"
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys
    assert dtypes == {"BF16"} and size <= SIZE_LIMIT


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("lowbit/demo_model"))
    parser.add_argument("--corpus", type=Path, default=Path("data/demo_corpus"))
    args = parser.parse_args()

    check_layout(args.model)
    model, info = AutoModelForCausalLM.from_pretrained(args.model, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"transformers loaded the model with problems: {problems}"
    model = model.float().eval()
    tok = AutoTokenizer.from_pretrained(args.model)

    heldout = args.corpus / "heldout.txt"
    if heldout.exists():
        stream = train.encode_documents(tok.backend_tokenizer, heldout)
        loss = train.heldout_loss(model, stream, 512, 16, "cpu")
        print(f"held-out: {stream.numel():,} tokens, loss {loss:.4f}, ppl {math.exp(loss):.2f}")

    prompt = "It is a truth universally acknowledged"
    ids = tok(prompt, return_tensors="pt").input_ids
    greedy = model.generate(ids, max_new_tokens=60, do_sample=False, repetition_penalty=1.2)
    print(f"--- greedy (repetition_penalty 1.2) ---\n{tok.decode(greedy[0])}")
    torch.manual_seed(0)
    sampled = model.generate(ids, max_new_tokens=60)  # generation_config.json: T 0.8, top-p 0.95
    print(f"--- sampled ---\n{tok.decode(sampled[0])}")
    messages = [{"role": "user", "content": "Continue: Elizabeth walked into the garden."}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    chat_ids = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    torch.manual_seed(0)
    reply = model.generate(chat_ids, max_new_tokens=80)
    print(f"--- chat ---\n{tok.decode(reply[0, chat_ids.shape[1] :])}")


if __name__ == "__main__":
    main()
