"""lowbit.bench.attention off the GPU: the table with the split-count sweep, and bad flags."""

import pytest

from lowbit.bench.attention import main, markdown


def _row(**extra):
    row = {"kv_dtype": "fp8", "B": 1, "context": 32768, "splits": 66, "kv_bytes": 34 << 20,
           "triton_us": 30.0, "triton_gbps": 1200.0, "triton_pct_copy": 40.0, "graph_us": 28.1,
           "graph_pct_copy": 42.0, "sdpa_us": None, "sdpa_pct_copy": None, "speedup_vs_sdpa": None}
    return {**row, **extra}


def test_markdown_lists_each_split_count():
    env = {"device": "GPU", "commit": "abc", "versions": {}, "command": "x"}
    sweep = [{"splits": 33, "graph_us": 31.5}, {"splits": 66, "graph_us": 28.1},
             {"splits": 128, "graph_us": 22.4}]
    md = markdown({"env": env, "copy_gbps": 2960.0, "copy_source": "measured",
                   "rows": [_row(splits_sweep=sweep), _row(B=8)]})
    assert "splits: graph us" in md
    assert "33: 31.5, 66: 28.1, 128: 22.4" in md
    assert md.count("| - |") >= 1  # the row without a sweep shows a dash there


@pytest.mark.parametrize("bad", ["two", "0,2", "-1"])
def test_split_factors_must_be_positive_numbers(bad, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path), f"--split-factors={bad}"])
    assert exc.value.code == 2
    assert "--split-factors" in capsys.readouterr().err
