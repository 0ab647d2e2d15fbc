import argparse

import pytest
import torch

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


def test_with_route_switches_opt_in_routes_on(capsys):
    """scripts/with_route.py: the named routes (OPT_IN or MEASURED_NEGATIVE) are their op's first choice inside the
    command (here `lowbit routes` prints them), and an unknown route fails with the valid names."""
    import importlib.util
    from pathlib import Path

    from lowbit.kernels import routes

    path = Path(__file__).resolve().parents[2] / "scripts" / "with_route.py"
    spec = importlib.util.spec_from_file_location("with_route", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    touched = [r for op in ("linear", "norm_gate", "rope_attention") for r in routes.ops()[op].routes]
    was = [r.status for r in touched]  # prefer() also sets aside the DEFAULT routes ahead
    try:
        assert mod.run(["linear", "torch_scaled_mm", "--", "routes"]) in (0, None)
        row = next(ln for ln in capsys.readouterr().out.splitlines() if "torch_scaled_mm" in ln)
        assert "DEFAULT" in row and was[touched.index(routes.ops()["linear"].get("torch_scaled_mm"))] == routes.OPT_IN
    finally:
        for route, status in zip(touched, was):
            route.status = status
    with pytest.raises(Exception, match="triton_tc_gemv"):
        mod.run(["linear", "no_such_route", "--", "routes"])
    try:  # several pairs: each route on (MEASURED_NEGATIVE ones too: an A/B may ask for them)
        assert mod.run(["norm_gate", "triton_norm_route", "rope_attention", "triton_rope_decode",
                        "--", "routes"]) in (0, None)
        out = capsys.readouterr().out.splitlines()
        for name in ("triton_norm_route", "triton_rope_decode"):
            assert "DEFAULT" in next(ln for ln in out if name in ln), name
    finally:
        for route, status in zip(touched, was):
            route.status = status
    with pytest.raises(SystemExit):
        mod.run(["norm_gate", "--", "routes"])  # an op without its route


def test_ncu_summary_groups_kernels_and_converts_units():
    """scripts/ncu_step.py --summarize: ncu's raw CSV (a header of metric names, a row of units,
    a row per kernel, thousands separators) becomes per-step rows grouped by kernel and grid,
    in us and bytes whatever unit ncu chose, with GB/s and the share of the copy bandwidth."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "ncu_step.py"
    spec = importlib.util.spec_from_file_location("ncu_step", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    head = ('"ID","Process ID","Kernel Name","dram__bytes_read.sum","gpu__time_duration.sum",'
            '"launch__grid_size","sm__warps_active.avg.pct_of_peak_sustained_active"')
    units = '"","","","Mbyte","ns","","%"'  # ncu 2025 prints "ns"; older ones "nsecond"
    rows = ['"0","1","void _tc_gemv_kernel(int *, float)","5.90","2,950","384","20.5"',
            '"1","1","_rms_norm_kernel","0.01","1,500,000","1","3.1"',
            '"2","1","void _tc_gemv_kernel(int *, float)","5.90","3,050","384","21.5"',
            '"3","1","void _tc_gemv_kernel(int *, float)","2.10","2,000","128","9.0"']
    text = "==PROF== Connected\n" + "\n".join([head, units, *rows]) + "\n==PROF== Disconnected\n"
    kernels = mod.read_ncu_csv(text)
    assert len(kernels) == 4 and kernels[1]["gpu__time_duration.sum"] == 1500.0
    assert kernels[0]["dram__bytes_read.sum"] == 5.9e6
    meta = {"device": "d", "commit": "c", "batch": 1, "steps": 2, "layers": 1, "copy_bandwidth_Bps": 4e12}
    s = mod.summarize(kernels, meta)
    big = next(r for r in s["rows"] if r["kernel"] == "_tc_gemv_kernel" and r["grid"] == 384)
    assert big["per_step"] == 1.0 and abs(big["us_per_step"] - 3.0) < 1e-9
    assert abs(big["gbps"] - 11.8e6 / 6.0 / 1e3) < 1e-6  # bytes over time, both launches
    assert abs(big["pct_copy"] - 100 * big["gbps"] * 1e9 / 4e12) < 1e-6
    assert abs(big["occupancy_pct"] - 21.0) < 1e-9
    assert s["rows"][0]["kernel"] == "_rms_norm_kernel"  # sorted by time a step
    assert abs(s["sum_us_per_step"] - (1500.0 + 2.95 + 3.05 + 2.0) / 2) < 1e-9
    assert "| _tc_gemv_kernel | 384 |" in mod.format_summary(s)
    with pytest.raises(SystemExit, match="no ncu CSV header"):
        mod.read_ncu_csv("==PROF== nothing profiled\n")


def test_graph_launch_cost_counts_the_node_kinds_of_a_graph_dump(tmp_path):
    """scripts/graph_launch_cost.py --dump: a cudaGraphDebugDotPrint file's node kinds (the
    upper-case type words of its labels), its edges, and its programmatic-dependency lines.
    The launch timing itself needs CUDA; without it the script says so and exits."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "graph_launch_cost.py"
    spec = importlib.util.spec_from_file_location("graph_launch_cost", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dot = tmp_path / "g.dot"
    dot.write_text('digraph dot {\n"n0"[label="{KERNEL | {ID | 0} | _tc_gemv_kernel}"];\n'
                   '"n1"[label="{MEMSET | {ID | 1}}"];\n"n2"[label="{KERNEL | {ID | 2}}"];\n'
                   '"n0" -> "n1";\n"n1" -> "n2" [label="programmatic"];\n}\n')
    assert mod.node_kinds(dot) == {"edges": 2, "programmatic": 1, "KERNEL": 2, "MEMSET": 1}
    if not torch.cuda.is_available():
        import sys
        argv = sys.argv
        try:
            sys.argv = ["graph_launch_cost.py"]
            with pytest.raises(SystemExit, match="needs CUDA"):
                mod.main()
        finally:
            sys.argv = argv
