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


def test_with_route_switches_one_opt_in_route_on(capsys):
    """scripts/with_route.py: the named OPT_IN route runs with DEFAULT status inside the
    command (here `lowbit routes` prints it), and an unknown route fails with the valid names."""
    import importlib.util
    from pathlib import Path

    from lowbit.kernels import routes

    path = Path(__file__).resolve().parents[2] / "scripts" / "with_route.py"
    spec = importlib.util.spec_from_file_location("with_route", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    route = routes.ops()["linear"].get("torch_scaled_mm")
    before = route.status
    try:
        assert mod.run(["linear", "torch_scaled_mm", "--", "routes"]) in (0, None)
        row = next(ln for ln in capsys.readouterr().out.splitlines() if "torch_scaled_mm" in ln)
        assert "DEFAULT" in row and before == routes.OPT_IN
    finally:
        route.status = before
    with pytest.raises(Exception, match="triton_tc_gemv"):
        mod.run(["linear", "no_such_route", "--", "routes"])
