import json

from lowbit.bench.record import append_md, write_record
from lowbit.bench.report import eval_points
from lowbit.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def _summary(tput: float) -> dict:
    return {"aggregate_throughput": tput, "per_user_tok_s": {"median": tput / 4}}


def _serve_record() -> dict:
    levels = [{"concurrency": c, "context": ctx, "summary": _summary(c * 10.0 / (1 + ctx / 1000))}
              for ctx in (0, 32768) for c in (1, 2, 4)]
    return {"kind": "serve", "model": "m", "levels": levels, "env": {"command": "x"}}


def test_report_plots_serve_and_skips_missing_eval(tmp_path, capsys):
    rec_dir, img = tmp_path / "records", tmp_path / "img"
    write_record(_serve_record(), rec_dir, "a")
    (rec_dir / "junk.json").write_text("{not json")
    assert main(["bench", "report", "--records", str(rec_dir), "--out", str(img)]) == 0
    out = capsys.readouterr().out
    assert (img / "serve_throughput.png").read_bytes().startswith(PNG)
    assert "eval (KL vs bpw): no records" in out and not (img / "kl_vs_bpw.png").exists()


def test_report_plots_kl_from_eval_records(tmp_path):
    rec_dir, img = tmp_path / "records", tmp_path / "img"
    teacher = {"format": "bf16", "bits_per_weight": 16.0, "kl_mean": 0.0}
    for student in ({"format": "nvfp4", "bits_per_weight": 4.5, "kl_mean": 0.02},
                    {"format": "nf3", "bits_per_weight": 3.25, "kl_mean": 0.09}):
        # the eval command's shape: the student on top, teacher and student under results
        write_record({"kind": "eval", **student, "results": [teacher, student]}, rec_dir)
    write_record({"kind": "eval", "format": "fp8", "bits_per_weight": 8.0, "kl_mean": 0.001}, rec_dir)
    lat = {"kind": "latency", "model": "m", "weight_format": "bf16",
           "cells": [{"test": "pp16", "tok_s_mean": 100.0, "tok_s_sd": 1.0},
                     {"test": "tg8", "tok_s_mean": 10.0, "tok_s_sd": 0.5}]}
    write_record(lat, rec_dir)
    assert main(["bench", "report", "--records", str(rec_dir), "--out", str(img)]) == 0
    assert (img / "kl_vs_bpw.png").read_bytes().startswith(PNG)
    assert (img / "latency.png").read_bytes().startswith(PNG)
    from lowbit.bench.record import load_records

    assert sorted(p["format"] for p in eval_points(load_records(rec_dir))) == ["bf16", "fp8", "nf3", "nvfp4"]


def test_append_md_creates_then_appends(tmp_path):
    md = tmp_path / "docs" / "BENCHMARKS.md"
    env = {"command": "lowbit bench x", "device": "cpu: test", "commit": "abc", "versions": {"torch": "2"}}
    append_md(md, "first", "| a |\n|---|", env)
    md.write_text(md.read_text() + "\n## someone else's section\n\nkept\n")
    append_md(md, "second", "body", env)
    text = md.read_text()
    assert text.startswith("# Benchmarks\n") and text.count("# Benchmarks") == 1
    assert text.index("## first") < text.index("someone else's") < text.index("## second")
    assert "Command: `lowbit bench x`" in text


def test_record_has_environment(tmp_path):
    path = write_record({"kind": "ab", "samples": [1, 2]}, tmp_path, "x y/z")
    rec = json.loads(path.read_text())
    assert path.name.endswith("-ab-x-y-z.json")
    assert rec["samples"] == [1, 2] and rec["env"]["versions"]["torch"] and "created" in rec
    assert write_record({"kind": "ab"}, tmp_path, "x y/z") != path  # same second: a new name
