import json
import math
from pathlib import Path

import pytest
import torch

from lowbit.bench.eval import evaluate, markdown, weight_sqnr, windows
from lowbit.checkpoint.loader import load_model
from lowbit.cli import main
from tests.conftest import TEXT


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("eval") / "held.txt"
    f.write_text(TEXT)
    return f


def test_windows_predict_every_token_once():
    ids = list(range(11))
    ws = windows(ids, 4)
    assert ws == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9, 10]]
    assert sum(len(w) - 1 for w in ws) == len(ids) - 1


def test_teacher_against_itself(tiny_moe_dir):
    a = load_model(tiny_moe_dir, dtype="float32")
    b = load_model(tiny_moe_dir, dtype="float32")
    ids = [(i * 37) % 250 for i in range(90)]
    t, s = evaluate(a, b, ids, 32)
    assert s.kl_mean == 0.0 and s.kl_p99 == 0.0 and s.top1 == 1.0
    assert s.ppl == t.ppl and s.tokens == t.tokens == 89
    assert s.sqnr_db is None  # nothing differs
    assert t.bits_per_weight == 16.0


def test_quantized_student(tiny_moe_dir):
    a = load_model(tiny_moe_dir, dtype="float32")
    ids = [(i * 37) % 250 for i in range(90)]
    rows = {}
    for fmt in ("fp8", "nf3"):
        b = load_model(tiny_moe_dir, dtype="float32", quantization=fmt)
        rows[fmt] = evaluate(a, b, ids, 40)[1]
    assert 0 < rows["fp8"].kl_mean < rows["nf3"].kl_mean
    assert rows["fp8"].kl_p99 >= rows["fp8"].kl_mean
    assert rows["fp8"].top1 >= rows["nf3"].top1 and rows["nf3"].top1 < 1.0
    assert 8 <= rows["fp8"].bits_per_weight < 9.5  # K = 16 and 32 here: the row scales weigh
    assert 3 < rows["nf3"].bits_per_weight < rows["fp8"].bits_per_weight
    # SQNR: fp8 (3 mantissa bits) ~ 30 dB; below its 8-bit Gaussian bound of 6.02 dB per bit
    assert 25 < rows["fp8"].sqnr_db < rows["fp8"].rd_bound_db
    assert rows["nf3"].sqnr_db < rows["fp8"].sqnr_db
    assert "| KL mean |" in markdown([rows["fp8"]])


def test_sqnr_matches_a_direct_computation(tiny_moe_dir):
    a = load_model(tiny_moe_dir, dtype="float32")
    b = load_model(tiny_moe_dir, dtype="float32", quantization="int4")
    w = a.model.model.layers[0].self_attn.q_proj.weight
    q = b.model.model.layers[0].self_attn.q_proj.weight.dequantize(torch.float32)
    one = 10 * math.log10(float(w.pow(2).sum() / (w - q).pow(2).sum()))
    assert abs(weight_sqnr(a.model, b.model) - one) < 3  # all weights vs one: same ballpark


def test_cli_writes_record(tiny_moe_dir, text_file, tmp_path, capsys):
    out = tmp_path / "eval-tiny-nvfp4.json"
    rc = main(["eval", str(tiny_moe_dir), "--teacher", str(tiny_moe_dir), "--text", str(text_file),
               "--max-tokens", "100", "--quantization", "nvfp4", "--json", str(out), "--device", "cpu"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| model | format |" in text and "nvfp4" in text
    rec = json.loads(out.read_text())
    for key in ("model", "format", "bits_per_weight", "ppl", "kl_mean", "kl_p99", "top1", "tokens"):
        assert key in rec
    assert rec["tokens"] == 100 and rec["format"].startswith("nvfp4") and rec["kind"] == "eval"
    assert rec["teacher"]["kl_mean"] == 0.0 and rec["kl_mean"] > 0


def test_cli_errors(tiny_moe_dir, text_file, capsys):
    assert main(["eval", str(tiny_moe_dir), "--teacher", str(tiny_moe_dir), "--text", str(text_file),
                 "--peer", "awq:4"]) == 2
    assert "hqq:BITS:GROUP" in capsys.readouterr().err


def test_cli_scores_several_students_into_a_curve_and_a_plot(tiny_moe_dir, text_file, tmp_path, capsys):
    """Two artifacts, each in two formats: four students on the same teacher tokens, a record
    each, the KL-vs-bits table sorted by bits per weight, and the PNG."""
    import shutil

    other = tmp_path / "copy"
    shutil.copytree(tiny_moe_dir, other)
    png = tmp_path / "curve.png"
    rc = main(["eval", str(tiny_moe_dir), str(other), "--teacher", str(tiny_moe_dir), "--text", str(text_file),
               "--max-tokens", "60", "--quantization", "nvfp4,nf3", "--json", str(tmp_path / "e-{format}.json"),
               "--plot", str(png), "--device", "cpu"])
    assert rc == 0
    out = capsys.readouterr().out
    table = out.split("KL to the teacher by bits per weight:")[1].split("wrote")[0]
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and "bits/weight" not in ln]
    assert len(rows) == 4
    bits = [float(r.split("|")[3]) for r in rows]
    assert bits == sorted(bits) and bits[0] < bits[-1]  # nf3 before nvfp4
    names = sorted(p.name for p in tmp_path.glob("e-*.json"))
    assert names == sorted(f"e-{d}-{f}.json" for d in (Path(tiny_moe_dir).name, "copy") for f in ("nvfp4", "nf3"))
    assert png.read_bytes().startswith(b"\x89PNG")


def test_cli_refuses_students_that_would_share_a_record(tiny_moe_dir, text_file, tmp_path, capsys):
    rc = main(["eval", str(tiny_moe_dir), str(tiny_moe_dir), "--teacher", str(tiny_moe_dir), "--text",
               str(text_file), "--json", str(tmp_path / "e-{format}.json"), "--device", "cpu"])
    assert rc == 2 and "same --json record" in capsys.readouterr().err
