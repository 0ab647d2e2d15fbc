import json
import os

import pytest

from lowbit.bench.latency import (
    HEADERS,
    Cell,
    Variant,
    add_depth_ratios,
    fitting_cells,
    summary_md,
    table_rows,
    usable_depths,
    weight_bytes,
)
from lowbit.bench.record import csv_text
from lowbit.checkpoint.loader import load_model
from lowbit.cli import main
from lowbit.errors import LowbitError


def test_latency_cells_table_and_record(tiny_moe_dir, tmp_path, capsys):
    rc = main(["bench", "latency", str(tiny_moe_dir), "-p", "16", "-n", "8", "-d", "0,32", "-r", "2",
               "--records", str(tmp_path), "--append-md", str(tmp_path / "B.md")])
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    assert rc == 0
    # progress on stderr as it goes, so a capped run says where it stopped
    for line in ("[latency] ready:", "[latency] warm-up pp16 done", "[latency] warm-up tg2 x1 done",
                 "[latency] depth 32: prefill", "[latency] tg8 @ d32 repeat 2/2:"):
        assert line in err
    assert err.index("ready:") < err.index("warm-up pp16") < err.index("pp16 repeat 1/2")
    assert "| model | format | dtype | device | test | t/s | ms/tok | GB/s | MBU |" in out
    for cell in ("| pp16 |", "| tg8 |", "| pp16 @ d32 |", "| tg8 @ d32 |"):
        assert cell in out
    (path,) = tmp_path.glob("*latency*.json")
    rec = json.loads(path.read_text())
    assert [c["test"] for c in rec["cells"]] == ["pp16", "tg8", "pp16 @ d32", "tg8 @ d32"]
    for c in rec["cells"]:
        assert len(c["samples_s"]) == 2 and all(t > 0 for t in c["samples_s"])
        assert c["tok_s_mean"] > 0 and c["ms_per_tok"] > 0
        if c["kind"] == "tg":
            assert 0 < c["mbu"] < 1 and c["bytes_per_step"] > rec["weight_bytes"]["active"]
    # deeper context reads more KV per token
    tg = {c["test"]: c for c in rec["cells"] if c["kind"] == "tg"}
    assert tg["tg8 @ d32"]["bytes_per_step"] > tg["tg8"]["bytes_per_step"]
    assert rec["time_to_ready_s"] > 0 and rec["memory"]["peak_rss_bytes"] > 0
    assert rec["copy_bandwidth_Bps"] > 1e8
    assert rec["env"]["versions"]["torch"] and rec["env"]["device"]
    csv = csv_text(HEADERS, table_rows(rec)).splitlines()
    assert csv[0] == "model,format,dtype,device,test,t/s,ms/tok,GB/s,MBU" and csv[2].split(",")[4] == "tg8"
    md = (tmp_path / "B.md").read_text()
    assert md.startswith("# Benchmarks\n") and "## bench latency" in md and "| tg8 @ d32 |" in md


def test_depths_that_fit():
    assert usable_depths([0, 32768], [512], [128], 40960, fit=True) == [0, 32768]
    assert usable_depths([0, 32768], [8], [4], 256, fit=True) == [0]
    with pytest.raises(LowbitError, match="lower -d/-p/-n"):
        usable_depths([0, 32768], [8], [4], 256, fit=False)
    # named depths: a depth some cell fits is kept (the others are skipped per cell) ...
    assert usable_depths([0, 32768], [512, 8192], [128], 40960, fit=False) == [0, 32768]
    # ... and one that not even the shortest cell fits is refused
    with pytest.raises(LowbitError, match="needs a context of"):
        usable_depths([0, 40900], [512], [128], 40960, fit=False)


def test_depth_ratio_and_its_bandwidth_bound():
    """A deep tg cell's rate over depth 0's, and the ratio its extra K/V bytes allow: a 2.5 ms
    step plus 3.2 GB at 3 TB/s (1.0667 ms) can run at most 2.5 / 3.5667 of depth 0's rate."""
    rows = [{"kind": "tg", "n": 128, "depth": 0, "batch": 1, "tok_s_mean": 400.0, "bytes_per_step": 2.2e9},
            {"kind": "tg", "n": 128, "depth": 32768, "batch": 1, "tok_s_mean": 280.0,
             "bytes_per_step": 5.4e9},
            {"kind": "pp", "n": 512, "depth": 32768, "batch": 1, "tok_s_mean": 5000.0},
            {"kind": "tg", "n": 64, "depth": 32768, "batch": 1, "tok_s_mean": 270.0, "bytes_per_step": 5.4e9}]
    out = add_depth_ratios(rows, 3.0e12)
    assert out[1]["vs_d0"] == pytest.approx(0.7)
    assert out[1]["vs_d0_bound"] == pytest.approx(2.5e-3 / (2.5e-3 + 3.2e9 / 3.0e12))
    assert "vs_d0" not in out[0] and "vs_d0" not in out[2]  # depth 0 itself, a pp cell
    assert "vs_d0" not in out[3]  # no tg64 at depth 0 to compare with
    foot = summary_md({"memory": {"peak_device_bytes": 0}, "time_to_ready_s": 1.0, "copy_bandwidth_Bps": 3e12,
                       "weight_bytes": {"active": 0}, "repeats": 1, "model": "m", "weight_format": "f",
                       "dtype": "bfloat16", "device": "cuda",
                       "cells": [dict(r, test=f"{r['kind']}{r['n']}", tok_s_sd=0.0, ms_per_tok=1.0) for r in out]})
    assert "tg128: 70.0 % of depth 0; its extra K/V bytes at the copy bandwidth allow at most 70.1 %" in foot


def test_cells_beyond_the_context_are_skipped_by_name():
    row = [Cell("pp", 512, 32768), Cell("pp", 8192, 32768), Cell("tg", 128, 32768)]
    kept, left_out = fitting_cells(row, 40960)
    assert [c.name for c in kept] == ["pp512 @ d32768", "tg128 @ d32768"]
    assert left_out == ["pp8192 @ d32768"]
    kept, left_out = fitting_cells([Cell("pp", 8191, 32768), Cell("tg", 8190, 32768)], 40960)
    assert len(kept) == 2 and not left_out  # exactly at the limit: 32768 + 8192 = 40960


def test_explicit_depth_beyond_context_is_refused(tiny_moe_dir, tmp_path, capsys):
    rc = main(["bench", "latency", str(tiny_moe_dir), "-d", "1000", "-p", "8", "-n", "4",
               "--records", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and not list(tmp_path.iterdir()) and "lower -d/-p/-n" in err
    assert "loading" not in err  # refused from the config, before the model loads


def test_named_depth_runs_the_cells_that_fit(tiny_moe_dir, tmp_path, capsys):
    """-d 200 -p 8,64 on a 256-token model: pp64 @ d200 does not fit, the rest runs, the
    skipped cell is warned on stderr and named in the record and its footer."""
    rc = main(["bench", "latency", str(tiny_moe_dir), "-d", "200", "-p", "8,64", "-n", "4",
               "-r", "1", "--device", "cpu", "--records", str(tmp_path), "-o", "json"])
    out, err = capsys.readouterr()
    assert rc == 0 and "WARNING: cell pp64 @ d200 skipped" in err
    rec = json.loads(next(tmp_path.glob("*-latency-*.json")).read_text())
    assert rec["skipped_cells"] == ["pp64 @ d200"]
    assert {c["test"] for c in rec["cells"]} == {"pp8 @ d200", "tg4 @ d200"}
    assert "WARNING cells skipped" in summary_md(rec)


def test_depth_cells_carry_their_ratio_to_depth_0(tiny_moe_dir, tmp_path):
    rc = main(["bench", "latency", str(tiny_moe_dir), "-d", "0,64", "-p", "8", "-n", "4", "-r", "1",
               "--device", "cpu", "--records", str(tmp_path), "-o", "json"])
    rec = json.loads(next(tmp_path.glob("*-latency-*.json")).read_text())
    deep = next(c for c in rec["cells"] if c["test"] == "tg4 @ d64")
    shallow = next(c for c in rec["cells"] if c["test"] == "tg4")
    assert rc == 0 and deep["vs_d0"] == pytest.approx(deep["tok_s_mean"] / shallow["tok_s_mean"])
    assert 0 < deep["vs_d0_bound"] < 1  # 64 more cached tokens are bytes the step must read


def test_weight_bytes_count_active_experts_only(tiny_moe_dir):
    loaded = load_model(tiny_moe_dir, dtype="float32")
    cfg, model = loaded.config, loaded.model
    wb = weight_bytes(model, cfg)
    experts = sum(p.nbytes for n, p in model.named_parameters() if ".experts." in n)
    embed = sum(p.nbytes for n, p in model.named_parameters() if "embed_tokens" in n)
    total = sum(p.nbytes for p in model.parameters())
    assert wb["experts_all"] == experts
    assert wb["dense"] == total - experts - embed + embed / cfg.vocab_size
    assert wb["active"] == wb["dense"] + experts * 2 / 4  # top-2 of 4 experts


def test_offload_cells_count_the_expert_copies_of_their_tokens(tiny_moe_dir, tmp_path, capsys):
    """With --expert-offload each cell records the bytes copied and misses per token it made,
    and the footer prints them for the tg cells."""
    rc = main(["bench", "latency", str(tiny_moe_dir), "-p", "8", "-n", "6", "-d", "0", "-r", "2",
               "--temperature", "1", "--expert-offload", "--expert-cache-slots", "2", "--records", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    (path,) = tmp_path.glob("*latency*.json")
    rec = json.loads(path.read_text())
    tg = next(c for c in rec["cells"] if c["kind"] == "tg")
    expert = rec["expert_cache"]["expert_bytes"]
    assert tg["expert_misses_per_token"] > 0
    assert tg["expert_copy_bytes_per_token"] >= tg["expert_misses_per_token"] * expert * 0.999
    assert f"tg6: {tg['expert_copy_bytes_per_token'] / 2**20:.1f} MiB of experts copied a token" in out


def test_variant_parse_and_refusals():
    v = Variant.parse("fused=norm_gate:triton_norm_route,rope_attention:triton_rope_decode,LOWBIT_DECODE_FOLD:1")
    assert v.label == "fused" and v.env == {"LOWBIT_DECODE_FOLD": "1"}
    assert v.routes == [("norm_gate", "triton_norm_route"), ("rope_attention", "triton_rope_decode")]
    assert v.items() == ["norm_gate:triton_norm_route", "rope_attention:triton_rope_decode",
                         "LOWBIT_DECODE_FOLD:1"]
    for bad, why in [("norm_gate:triton_norm_route", "expected LABEL="), ("base=LOWBIT_DECODE_FOLD:1", "other than"),
                     ("x=norm_gate:nope", "no route norm_gate:nope"), ("x=nosuchop:r", "no route nosuchop:r"),
                     ("x=LOWBIT_PDL:0", "not read at every call"), ("x=norm_gate", "is not OP:ROUTE")]:
        with pytest.raises(LowbitError, match=why):
            Variant.parse(bad)


def test_a_variant_can_time_a_tuners_launch_configs(tmp_path):
    """LOWBIT_LAUNCH_CONFIGS:<path> is a variant switch; the file is checked when the variant
    is parsed, before a model loads."""
    good = tmp_path / "tuned.json"
    good.write_text('{"device": "NVIDIA H200", "tc_moe": {"nvfp4:128x2048": {"1": {"fc1": {"BN": 32}}}}}')
    assert Variant.parse(f"tuned=LOWBIT_LAUNCH_CONFIGS:{good}").env == {"LOWBIT_LAUNCH_CONFIGS": str(good)}
    with pytest.raises(LowbitError, match="not a readable JSON"):
        Variant.parse(f"tuned=LOWBIT_LAUNCH_CONFIGS:{tmp_path / 'missing.json'}")


def test_variants_interleave_in_one_process_and_restore(tiny_moe_dir, tmp_path, capsys, monkeypatch):
    """Two variants beside the base: every cell timed under each, repeat by repeat in turn
    (base, fold, gate; base, fold, gate), one record with their cells; the switches and the
    route statuses are as before the run once it ends."""
    from lowbit.kernels import routes
    monkeypatch.delenv("LOWBIT_DECODE_FOLD", raising=False)
    status = routes.ops()["norm_gate"].get("triton_norm_gate").status
    rc = main(["bench", "latency", str(tiny_moe_dir), "-d", "0", "-p", "8", "-n", "4", "-r", "2",
               "--device", "cpu", "--records", str(tmp_path), "-o", "json",
               "--variant", "fold=LOWBIT_DECODE_FOLD:1", "--variant", "gate=norm_gate:triton_norm_gate"])
    err = capsys.readouterr().err
    assert rc == 0
    rec = json.loads(next(tmp_path.glob("*-latency-*.json")).read_text())
    assert [v["label"] for v in rec["variants"]] == ["fold", "gate"]
    for v in rec["variants"]:
        assert [c["test"] for c in v["cells"]] == [c["test"] for c in rec["cells"]] == ["pp8", "tg4"]
        assert all(len(c["samples_s"]) == 2 for c in v["cells"])
    order = [line.split(":")[0].removeprefix("[latency] ") for line in err.splitlines() if "] repeat" in line
             and line.startswith("[latency] tg4")]
    assert order == ["tg4 [base] repeat 1/2", "tg4 [fold] repeat 1/2", "tg4 [gate] repeat 1/2",
                     "tg4 [base] repeat 2/2", "tg4 [fold] repeat 2/2", "tg4 [gate] repeat 2/2"]
    assert "LOWBIT_DECODE_FOLD" not in os.environ
    assert routes.ops()["norm_gate"].get("triton_norm_gate").status == status
    assert "variant gate (norm_gate:triton_norm_gate), interleaved with the base" in summary_md(rec)


def test_a_variant_makes_its_route_the_first_choice():
    """OP:ROUTE gives ROUTE DEFAULT status and sets aside the op's DEFAULT routes ahead of it,
    so a variant can also time a promoted route's predecessor (norm_gate:unfused against
    DEFAULT triton_norm_gate); the base gets every status back."""
    from types import SimpleNamespace

    from lowbit.bench.latency import Variants
    from lowbit.kernels import routes

    op = routes.ops()["norm_gate"]
    before = {r.name: r.status for r in op.routes}
    assert before["triton_norm_gate"] == routes.DEFAULT and op.names()[-1] == "unfused"
    runner = SimpleNamespace(graphs=None, prefill_graphs=None, fresh_graphs=lambda: (None, None),
                             use_graphs=lambda pair: None)
    s = SimpleNamespace(llm=SimpleNamespace(engine=SimpleNamespace(runner=runner)))
    vs = Variants(s, [Variant.parse("off=norm_gate:unfused"), Variant.parse("rank=norm_gate:triton_norm_route")])
    try:
        vs.apply("off")
        now = {r.name: r.status for r in op.routes}
        assert now["unfused"] == routes.DEFAULT and now["triton_norm_gate"] == routes.OPT_IN
        assert now["triton_norm_route"] == routes.MEASURED_NEGATIVE  # not DEFAULT: left as it is
        vs.apply("rank")  # first in order: nothing ahead of it; the last variant's changes undone
        now = {r.name: r.status for r in op.routes}
        assert now["triton_norm_route"] == routes.DEFAULT and now["triton_norm_gate"] == routes.DEFAULT
        vs.apply("base")
        assert {r.name: r.status for r in op.routes} == before
    finally:
        for r in op.routes:
            r.status = before[r.name]
