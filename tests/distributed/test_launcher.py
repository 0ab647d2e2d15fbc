"""`lowbit generate --tensor-parallel-size 2 --expert-parallel-size 2` starts a second
process itself, drives it from rank 0 (the engine, KV cache twins, logits gathered) and
prints what one process prints; a shape that cannot be split fails on every rank, cleanly."""

from __future__ import annotations

import json
import subprocess
import sys

from lowbit.cli import main

PROMPT = "It is a truth universally"
TIMEOUT_S = 120  # a hang (a rank left inside a collective) fails instead of blocking the suite


def lowbit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lowbit", *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def test_generate_tp2_ep2_prints_what_one_process_prints(tiny_moe_dir, capsys):
    common = ["generate", str(tiny_moe_dir), PROMPT, "--max-tokens", "6", "--device", "cpu", "--quiet-stats"]
    assert main(common) == 0
    want = capsys.readouterr().out
    got = lowbit(*common, "--tensor-parallel-size", "2", "--expert-parallel-size", "2")
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout == want and want.startswith(PROMPT)


def test_unsplittable_model_fails_on_every_rank(tmp_path):
    cfg = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 24, "intermediate_size": 32,
           "moe_intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 3,
           "num_key_value_heads": 1, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
           "max_position_embeddings": 32, "rms_norm_eps": 1e-6}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    got = lowbit("generate", "x", "hi", "--random-weights", "--config", str(tmp_path / "config.json"),
                 "--device", "cpu", "--max-tokens", "2", "--tensor-parallel-size", "2")
    assert got.returncode == 2, got.stderr[-3000:]
    assert "3 heads do not split over 2 ranks" in got.stderr
