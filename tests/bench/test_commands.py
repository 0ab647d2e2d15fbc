import argparse

import pytest

from lowbit.bench.commands import int_list
from lowbit.cli import main


def test_int_lists():
    assert int_list("1,2, 4") == [1, 2, 4]
    assert int_list("0,32k") == [0, 32768]
    with pytest.raises(argparse.ArgumentTypeError):
        int_list("1,x")


def test_bench_kernels_passes_its_flags_through(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "kernels", "--help"])
    assert e.value.code == 0 and "--quick" in capsys.readouterr().out


def test_bench_needs_a_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["bench"])
    assert "latency" in capsys.readouterr().err
