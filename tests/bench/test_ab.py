import json
import sys

import pytest

from lowbit.bench.ab import parse_metric, verdict
from lowbit.cli import main

PY = sys.executable


def _cmd(text: str) -> str:
    return f"{PY} -c 'print(\"{text}\")'"


def test_same_commands_show_no_difference(tmp_path, capsys):
    rc = main(["bench", "ab", _cmd("decode 5 tok/s"), _cmd("decode 5.0 tok/s"), "--rounds", "3",
               "--records", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "no difference beyond spread" in out
    rec = json.loads(next(tmp_path.glob("*ab*.json")).read_text())
    assert [r["order"] for r in rec["rounds"]] == ["AB", "BA", "AB"]
    assert rec["A"]["median"] == rec["B"]["median"] == 5.0
    assert rec["A"]["iqr"] == 0


def test_clear_difference_is_stated(tmp_path, capsys):
    rc = main(["bench", "ab", _cmd("5 tok/s"), _cmd("warm 1 tok/s then 50 tok/s"), "--rounds", "2",
               "--records", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "B is higher than A" in out and "+900.0%" in out


def test_custom_metric_and_missing_number(tmp_path, capsys):
    rc = main(["bench", "ab", _cmd("latency=12 ms"), _cmd("latency=9 ms"), "--rounds", "2",
               "--metric", r"latency=(\d+) ms", "--records", str(tmp_path)])
    assert rc == 0 and "A is higher than B" in capsys.readouterr().out
    rc = main(["bench", "ab", _cmd("nothing"), _cmd("nothing"), "--rounds", "1", "--records", str(tmp_path)])
    assert rc == 2 and "--metric" in capsys.readouterr().err


def test_parse_and_verdict_rules():
    assert parse_metric("prefill 900 tok/s\ndecode 12.5 tok/s") == 12.5
    assert parse_metric("x 1e3 tok/s") == 1000.0
    assert parse_metric("no numbers") is None
    # overlapping ranges: no claim even though the medians differ
    assert verdict([10, 12, 14], [11, 13, 15]).startswith("no difference")
    assert verdict([10, 11, 12], [13, 14, 15]).startswith("B is higher")
    assert pytest.approx(40.0) == float(verdict([10, 10], [14, 14]).split("B/A ")[1].split("%")[0])
