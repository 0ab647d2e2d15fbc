"""`lowbit bench fingerprint`: greedy outputs for a fixed prompt set, hashed.

A fingerprint is sha256 of the generated token ids written as decimal numbers joined by
commas (ASCII), one per prompt. Prompts: code, prose, counting and a long-context prompt
(a numbered haystack with a question at the end, cut to fit the model's context). A
model without a tokenizer (--random-weights) gets seeded token ids of similar lengths.
Each prompt runs alone (no batching), greedy, ignoring EOS, for --max-tokens tokens.
"""

from __future__ import annotations

import hashlib
import json
import random
import zlib
from pathlib import Path

from lowbit import LLM, SamplingParams
from lowbit.config import EngineConfig
from lowbit.distributed import engine_model
from lowbit.errors import LowbitError

PROMPTS = {
    "code": 'def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    """Merge two sorted'
            ' lists into one sorted list."""\n',
    "prose": "The harbour was quiet in the early morning, and the fishing boats rocked gently "
             "against the pier while the gulls",
    "counting": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
}
LONG_LINE = "Line {i}: the lantern at gate {g} is {c}, and the keeper writes it in the log.\n"
LONG_QUESTION = "\nQuestion: what colour is the lantern at gate 7? Answer:"
COLOURS = ("red", "green", "blue", "amber", "white")
RANDOM_LENGTHS = {"code": 28, "prose": 24, "counting": 36}


def digest(ids: list[int]) -> str:
    return hashlib.sha256(",".join(str(int(t)) for t in ids).encode()).hexdigest()


def prompt_set(llm, max_tokens: int, long_len: int) -> dict[str, list[int]]:
    room = llm.max_model_len - max_tokens - 1
    long_len = min(long_len, room)
    if llm.tokenizer is None:
        rngs = {n: random.Random(zlib.crc32(n.encode())) for n in [*RANDOM_LENGTHS, "long"]}
        lengths = {**RANDOM_LENGTHS, "long": long_len}
        return {n: [rngs[n].randrange(llm.config.vocab_size) for _ in range(k)] for n, k in lengths.items()}
    out = {n: llm.tokenizer.encode(t) for n, t in PROMPTS.items()}
    body = "".join(LONG_LINE.format(i=i, g=i % 50, c=COLOURS[i % 5]) for i in range(2000))
    question = llm.tokenizer.encode(LONG_QUESTION, add_special_tokens=False)
    out["long"] = llm.tokenizer.encode(body)[: max(long_len - len(question), 1)] + question
    return out


def fingerprint(cfg: EngineConfig, max_tokens: int = 32, long_len: int = 1536,
                fmt: str | None = None) -> dict:
    llm = LLM(**cfg.llm_kwargs(), loaded=engine_model(cfg))
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = {}
    for name, ids in prompt_set(llm, max_tokens, long_len).items():
        out = llm.generate([ids], sp)[0].outputs[0].token_ids
        prompts[name] = {"prompt_tokens": len(ids), "prompt_sha256": digest(ids),
                         "sha256": digest(out), "tokens": list(out)}
    return {"kind": "fingerprint", "model": cfg.config if cfg.random_weights else cfg.model,
            "format": fmt or llm.loaded.weight_format, "device": llm.device,
            "dtype": str(next(llm.model.parameters()).dtype).removeprefix("torch."),
            "max_tokens": max_tokens, "prompts": prompts}


def stored_text(rec: dict) -> str:
    """The stored fingerprint file: no timestamps or host details, one line per prompt."""
    head = {k: rec[k] for k in ("kind", "format", "dtype", "device", "max_tokens")}
    head["model"] = Path(str(rec["model"])).name
    lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    prompts = [f"  {json.dumps(n)}: {json.dumps(p)}" for n, p in rec["prompts"].items()]
    return "{\n" + "\n".join(lines) + '\n "prompts": {\n' + ",\n".join(prompts) + "\n }\n}\n"


def compare(rec: dict, stored_path: str | Path) -> list[str]:
    """One line per prompt whose prompt or output differs from the stored file."""
    p = Path(stored_path)
    if not p.exists():
        raise LowbitError(f"no fingerprint file at {p}; write one with --out {p}")
    stored = json.loads(p.read_text())["prompts"]
    problems = []
    for name, want in stored.items():
        got = rec["prompts"].get(name)
        if got is None:
            problems.append(f"{name}: not computed")
        elif got["prompt_sha256"] != want["prompt_sha256"]:
            problems.append(f"{name}: the prompt tokens differ (tokenizer or prompt changed)")
        elif got["sha256"] != want["sha256"]:
            at = next((i for i, (a, b) in enumerate(zip(got["tokens"], want.get("tokens", []))) if a != b),
                      min(len(got["tokens"]), len(want.get("tokens", []))))
            problems.append(f"{name}: output differs from token {at} on "
                            f"(got {got['tokens'][at:at + 4]}, stored {want.get('tokens', [])[at:at + 4]})")
    return problems
