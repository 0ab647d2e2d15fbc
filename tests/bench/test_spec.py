import json

import pytest

from lowbit.bench.record import csv_text
from lowbit.bench.spec import HEADERS, steady_speedup, summary_md, table_rows
from lowbit.cli import main


def test_latency_spec_table_and_record(tiny_moe_dir, tmp_path, capsys):
    """The model drafting for itself: every draft accepted, the same tokens, both arms timed."""
    rc = main(["bench", "latency", str(tiny_moe_dir), "--spec", "draft", "--speculative-model", str(tiny_moe_dir),
               "--num-speculative-tokens", "2", "-n", "8", "-r", "2", "--records", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "[latency] tg8 repeat 2/2:" in err
    assert "| model | method | k | test | plain t/s | spec t/s | speedup | accepted len |" in out
    (path,) = tmp_path.glob("*latency_spec*.json")
    rec = json.loads(path.read_text())
    assert rec["method"] == "draft" and rec["num_speculative_tokens"] == 2
    (cell,) = rec["cells"]
    assert cell["same_tokens"] and cell["accept_rate_per_position"] == [1.0, 1.0]
    assert cell["accepted"] == cell["drafts"] > 0
    # 8 tokens after the first: 3 + 3 + 2 (the last step drafts 1, for the 2 tokens left)
    assert cell["mean_accepted_length"] == pytest.approx(8 / 3)
    assert len(cell["samples_s"]["plain"]) == len(cell["samples_s"]["spec"]) == 2
    assert cell["captures"] == [0, 0] and rec["step_profiles"] == {}  # no CUDA graphs or profiles here
    assert "WARNING" not in out
    cell["captures"] = [1, 0]  # a timed repeat that captured a graph is flagged in the footer
    assert "WARNING tg8: timed speculative repeats captured CUDA graphs ([1, 0] by repeat)" in summary_md(rec)
    assert "captured none" not in summary_md(rec)  # no steady figure unless the cell has one
    cell.update(steady_speedup(cell["samples_s"], [1, 0], 8))
    assert cell["steady_repeats"] == [1]
    assert "over the 1 that captured none: " in summary_md(rec)
    assert cell["speedup"] == cell["tok_s_spec"][0] / cell["tok_s_plain"][0] > 0
    assert [r["T"] for r in rec["verify"]] == [1, 2, 4, 8] and rec["verify"][0]["ratio"] == 1.0
    assert all(r["s"] > 0 and len(r["samples_s"]) == 2 for r in rec["verify"])
    assert "| T (verify tokens, B = 1) | ms | x decode step | forward |" in out
    assert all(r["how"] == "eager" for r in rec["verify"])  # CUDA replays a captured graph
    model = cell["cost_model"]
    assert len(model["expected_tok_s"]) == 3 and model["k"] in (0, 1, 2) and model["draft_s_per_token"] >= 0
    assert "cost model's choice" in out
    assert rec["draft_chains"] == "draft chains run eagerly (no CUDA graphs here)" and rec["draft_chains"] in out
    csv = csv_text(HEADERS, table_rows(rec)).splitlines()
    assert csv[1].split(",")[1:4] == ["draft", "2", "tg8"]


def test_latency_spec_synthetic_acceptance(tiny_moe_dir, tmp_path, capsys):
    """--spec-synthetic-accept 1: every draft kept whatever the model says; the record, the
    table and a warning say so, and the tokens are not compared."""
    rc = main(["bench", "latency", str(tiny_moe_dir), "--spec", "ngram", "--spec-synthetic-accept", "1",
               "--num-speculative-tokens", "2", "-n", "8", "-r", "1", "--records", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "not the model's output" in err
    assert "| ngram (SYNTHETIC accept 1) | 2 | tg8 |" in out and "SYNTHETIC: drafts accepted" in out
    (path,) = tmp_path.glob("*latency_spec*.json")
    rec = json.loads(path.read_text())
    assert rec["synthetic"] is True and rec["outputs_compared"] is False
    assert rec["synthetic_accept_rate"] == 1 and rec["synthetic_expected_accepted_length"] == 3
    (cell,) = rec["cells"]
    assert cell["same_tokens"] is None and cell["accept_rate_per_position"] == [1.0, 1.0]
    assert cell["mean_accepted_length"] == pytest.approx(8 / 3)  # 3 + 3 + 2, as the self-draft above
    assert table_rows(rec)[0][-1] == "not compared"
    assert cell["speedup_at_expected_length"] == pytest.approx(cell["speedup"] * 3 / (8 / 3))
    assert "at the expected accepted length (3.00; these draws gave 2.67" in out


def test_synthetic_acceptance_needs_spec(capsys):
    assert main(["bench", "latency", "demo", "--spec-synthetic-accept", "0.7", "-n", "8"]) != 0
    assert "add --spec METHOD" in capsys.readouterr().err


def test_latency_spec_adaptive_records_the_engines_choices(tiny_moe_dir, tmp_path, capsys):
    rc = main(["bench", "latency", str(tiny_moe_dir), "--spec", "ngram", "--speculative-adaptive",
               "--spec-synthetic-accept", "1", "--num-speculative-tokens", "2", "-n", "64", "-r", "2",
               "--records", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    (path,) = tmp_path.glob("*latency_spec*.json")
    rec = json.loads(path.read_text())
    assert rec["adaptive"] is True and rec["adaptive_steps"] > 0
    assert rec["k_history"] and all(h["batch_bucket"] == 1 and 0 <= h["k"] <= 2 for h in rec["k_history"])
    assert rec["k_now"] == {"1": rec["k_history"][-1]["k"]} == rec["cells"][0]["k_now"]
    assert table_rows(rec)[0][2] == f"auto <= 2, now B1:{rec['k_now']['1']}"
    assert "k chosen by the engine (--speculative-adaptive" in out
    assert "speedup_at_expected_length" not in rec["cells"][0]  # k varies: no one expected length


def test_steady_speedup_leaves_out_the_repeats_that_captured():
    """Capture time is not decode time: the steady figure is the mean rate of the quiet repeats
    (hand-made times: plain 1 s each; spec 4 s while capturing, then 0.5 and 0.25 s)."""
    times = {"plain": [1.0, 1.0, 1.0], "spec": [4.0, 0.5, 0.25]}
    got = steady_speedup(times, [2, 0, 0], 8)
    assert got["steady_repeats"] == [1, 2]
    assert got["steady_speedup"] == pytest.approx((16 + 32) / 2 / 8)  # spec 16 and 32 tok/s, plain 8
    assert steady_speedup(times, [0, 0, 0], 8) == {} and steady_speedup(times, [1, 1, 1], 8) == {}
