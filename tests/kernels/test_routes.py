"""The route registry: selection, forcing (fail closed), strict env parsing, counters."""

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.errors import LowbitError  # noqa: E402
from lowbit.kernels import linear, moe_experts, routes  # noqa: E402
from lowbit.kernels.routes import DEFAULT, MEASURED_NEGATIVE, OPT_IN, Route  # noqa: E402


class Call:
    def __init__(self, size: int) -> None:
        self.size = size


def _make_op(name: str) -> None:
    if name in routes.ops():
        return
    routes.register(name, Route("small", DEFAULT, "BENCH#a",
                                lambda c: None if c.size < 10 else "too big", lambda c: "small"))
    routes.register(name, Route("fancy", OPT_IN, "BENCH#b",
                                lambda c: None if c.size % 2 == 0 else "odd size", lambda c: "fancy"))
    routes.register(name, Route("slow", MEASURED_NEGATIVE, "0.7x the reference",
                                lambda c: None, lambda c: "slow"))
    routes.register(name, Route("torch", DEFAULT, "reference", lambda c: None, lambda c: "torch"),
                    reference=True)


@pytest.fixture()
def op(monkeypatch):
    _make_op("t_op")
    monkeypatch.delenv("LOWBIT_ROUTE_T_OP", raising=False)
    routes.reset_counters()
    return "t_op"


def test_first_default_that_admits(op):
    assert routes.dispatch(op, Call(3), "L0") == "small"
    assert routes.dispatch(op, Call(12), "L0") == "torch"  # small refuses, fancy is opt-in
    counts = routes.counters()
    assert {"op": op, "layer": "L0", "route": "torch", "count": 1} in counts["route_calls"]
    assert {"op": op, "layer": "L0", "route": "small", "reason": "too big", "count": 1} in counts["route_refusals"]


def test_forced_route_runs_even_if_opt_in(op, monkeypatch):
    monkeypatch.setenv("LOWBIT_ROUTE_T_OP", "fancy")
    assert routes.dispatch(op, Call(12)) == "fancy"
    monkeypatch.setenv("LOWBIT_ROUTE_T_OP", "slow")
    assert routes.dispatch(op, Call(12)) == "slow"


def test_forced_route_that_refuses_fails_closed(op, monkeypatch):
    monkeypatch.setenv("LOWBIT_ROUTE_T_OP", "fancy")
    with pytest.raises(LowbitError, match="odd size"):
        routes.dispatch(op, Call(3))


def test_misspelt_route_lists_valid_names(op, monkeypatch):
    monkeypatch.setenv("LOWBIT_ROUTE_T_OP", "fancyy")
    with pytest.raises(LowbitError, match="small, fancy, slow, torch"):
        routes.dispatch(op, Call(3))


@pytest.mark.parametrize("value", ["", "auto", " auto "])
def test_auto_and_empty_mean_unforced(op, monkeypatch, value):
    monkeypatch.setenv("LOWBIT_ROUTE_T_OP", value)
    assert routes.dispatch(op, Call(3)) == "small"


def test_check_env_strict(op):
    routes.check_env({"LOWBIT_ROUTE_T_OP": "fancy", "LOWBIT_ROUTE_MOE": "auto"})
    for typo in ("LOWBIT_ROUTE_LINEAER", "LOWBIT_ROUTE_SAMPLER"):  # no such op
        with pytest.raises(LowbitError, match="names no op"):
            routes.check_env({typo: "torch"})
    with pytest.raises(LowbitError, match="valid names"):
        routes.check_env({"LOWBIT_ROUTE_LINEAR": "trition_lut_gemv"})


def test_registration_rules(op):
    with pytest.raises(AssertionError, match="must stay last"):
        routes.register(op, Route("late", DEFAULT, "x", lambda c: None, lambda c: None))
    with pytest.raises(AssertionError, match="cites a record"):
        Route("bare", DEFAULT, "", lambda c: None, lambda c: None)
    with pytest.raises(AssertionError, match="status"):
        Route("odd", "ON", "x", lambda c: None, lambda c: None)


def test_route_table_rows(op):
    routes.dispatch(op, Call(12), "layers.0")
    rows = [r for r in routes.route_table() if r["op"] == op]
    assert [r["route"] for r in rows] == ["small", "fancy", "slow", "torch"]
    torch_row = rows[-1]
    assert torch_row["calls"] == 1 and torch_row["status"] == DEFAULT
    assert rows[0]["refusals"] == 1 and rows[2]["record"] == "0.7x the reference"
    assert "fancy" in routes.format_table(rows)


def test_every_real_route_cites_a_record():
    names = {op: [r.name for r in o.routes] for op, o in routes.ops().items()}
    assert names["linear"] == ["dense", "triton_tc_gemv", "triton_lut_gemv", "triton_lut_dequant",
                               "triton_lut_gemm", "triton_fp8_w8a16", "triton_fp8_w8a8", "torch_scaled_mm",
                               "triton_vq_gemv",
                               "torch"]
    assert names["moe"] == ["triton_moe_shared_slots", "triton_tc_moe", "triton_vq_moe", "triton_moe_dense_shared",
                            "triton_fused_moe_decode", "triton_moe_grouped", "torch"]
    for row in routes.route_table():
        if row["op"] in ("linear", "moe") and row["status"] == DEFAULT and row["route"] != "torch":
            assert "docs/BENCHMARKS.md#" in row["record"], row
        if row["op"] == "moe" and row["status"] == DEFAULT and row["route"] != "torch":
            assert row["record"].startswith("docs/BENCHMARKS.md#"), row


def test_linear_dense_takes_the_dense_route(monkeypatch):
    monkeypatch.delenv("LOWBIT_ROUTE_LINEAR", raising=False)
    routes.reset_counters()
    x, w, b = torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(5)
    y = linear(x, w, b, layer="blk.0")
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b))
    assert {"op": "linear", "layer": "blk.0", "route": "dense", "count": 1} in routes.counters()["route_calls"]
    assert not routes.counters()["route_refusals"]  # a dense call evaluates no other admission


def test_forcing_a_kernel_on_dense_weights_names_the_reason(monkeypatch):
    monkeypatch.setenv("LOWBIT_ROUTE_LINEAR", "triton_lut_gemv")
    with pytest.raises(LowbitError, match="DenseWeight"):
        linear(torch.randn(2, 8), torch.randn(5, 8))


def test_moe_torch_route_matches_a_plain_loop(monkeypatch):
    monkeypatch.delenv("LOWBIT_ROUTE_MOE", raising=False)
    torch.manual_seed(0)
    x, w13, w2 = torch.randn(3, 8), torch.randn(4, 12, 8), torch.randn(4, 8, 6)
    ids = torch.tensor([[0, 2], [2, 3], [0, 2]], dtype=torch.int32)
    wts = torch.rand(3, 2)
    ref = torch.zeros(3, 8)
    for t in range(3):
        for j in range(2):
            h = w13[ids[t, j]] @ x[t]
            ref[t] += wts[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(h[:6]) * h[6:]))
    torch.testing.assert_close(moe_experts(x, ids, wts, w13, w2), ref, rtol=1e-5, atol=1e-5)


def test_auto_gemv_limited_to_measured_m(monkeypatch):
    from lowbit.kernels.linear_op import LinearCall, _admit_lut_gemv
    from lowbit.kernels.samples import random_lut_view
    from lowbit.kernels.weights import resolve

    w = resolve(random_lut_view(16, 64))
    call = LinearCall(torch.randn(8, 64), w, None, (8, 16), forced=False)
    assert "not measured faster" in _admit_lut_gemv(call)
    call.forced = True
    assert _admit_lut_gemv(call) is None  # the interpreter runs it when forced
    call.forced, call.x = False, torch.randn(2, 64)
    assert "cpu" in _admit_lut_gemv(call)  # auto selection keeps the torch route on a CPU


def test_measured_choice_between_gemv_and_gemm(monkeypatch):
    """A device file's "choice" table decides gemv or gemm per shape and M bucket; shapes it
    does not list keep the M <= 4 rule."""
    from lowbit.kernels import launch
    from lowbit.kernels.dequant_gemm import fmt_key
    from lowbit.kernels.linear_op import LinearCall, _admit_lut_gemv
    from lowbit.kernels.samples import random_lut_view
    from lowbit.kernels.weights import resolve

    w = resolve(random_lut_view(16, 64))
    key = f"{fmt_key(w)}:16x64"
    table = {"choice": {key: {"1": "gemv", "4": "gemm", "16": "gemv"}}}
    monkeypatch.setattr(launch, "_file", lambda name: table if name == "cpu" else {})
    monkeypatch.setattr(launch, "_device_file", lambda name: name)  # the (cached) file lookup: this table
    assert launch.choice(fmt_key(w), 16, 64, 3) == "gemm" and launch.choice(fmt_key(w), 16, 64, 99) == "gemv"
    assert launch.choice(fmt_key(w), 32, 64, 1) is None
    call = LinearCall(torch.randn(3, 64), w, None, (3, 16), forced=False)
    assert "gemm was measured faster at 16x64" in _admit_lut_gemv(call)
    call.x = torch.randn(9, 64)  # bucket 16 says gemv: the M <= 4 rule does not apply
    assert "not measured faster" not in (_admit_lut_gemv(call) or "")


def test_fp8_decode_is_refused_below_sm89(monkeypatch):
    from lowbit.kernels import runtime
    from tests.kernels.cases import make_weight

    x = torch.randn(2, 64)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(runtime, "capability", lambda index=0: (8, 0))
    for case, refused in (("fp8_channel", True), ("nvfp4_two_tables", True), ("nf4", False)):
        reason = runtime.fp8_refusal(x, make_weight(case, 8, 64))
        assert (reason is not None and "8.9" in reason) == refused, case
    monkeypatch.setattr(runtime, "capability", lambda index=0: (9, 0))
    assert runtime.fp8_refusal(x, make_weight("fp8_channel", 8, 64)) is None


def test_fallback_warns_once_except_in_a_start_up_probe(monkeypatch, caplog):
    """A CUDA call that the fast routes refuse warns on stderr once; inside
    routes.start_up_probe (the engine's memory-profile forward) it is logged at INFO only
    and the WARNING is still there for the first serving call."""
    import logging
    from dataclasses import dataclass as dc

    @dc
    class Call:
        forced: bool = False

    monkeypatch.setattr(routes, "_OPS", dict(routes._OPS))
    monkeypatch.setattr(routes, "_WARNED", set())
    monkeypatch.setattr(routes, "_on_cuda", lambda call: True)
    routes.register("probe_op", routes.Route("fast", DEFAULT, "x", lambda c: "shape unsupported", lambda c: 1))
    routes.register("probe_op", routes.Route("torch", DEFAULT, "ref", lambda c: None, lambda c: 2),
                    reference=True)
    caplog.set_level(logging.INFO, logger=routes.log.name)
    with routes.start_up_probe("memory profile"):
        assert routes.dispatch("probe_op", Call()) == 2
    assert routes.warned_fallbacks() == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert routes.dispatch("probe_op", Call()) == 2
    routes.dispatch("probe_op", Call())
    assert routes.warned_fallbacks() == ["probe_op: fast: shape unsupported"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "reference route on CUDA (slow)" in warnings[0].getMessage()


@pytest.mark.parametrize("case,t,want", [
    ("nvfp4_two_tables", 32, "gemv"),  # nvfp4 keeps the per-slot gemv up to 32 tokens
    ("nvfp4_two_tables", 33, None),  # then the grouped route
    ("int4_g32_offsets", 32, None),  # int4: grouped tiles from 17 tokens
    ("int4_g32_offsets", 16, "gemv"),  # 128 slots < 2 E
])
def test_moe_decode_route_token_limits(monkeypatch, case, t, want):
    """Which kernel the decode route runs at batched-decode sizes (E = 128, top-8), from the
    C32 / C64 kernel records: the route's admission and its gemv-or-tiles choice."""
    from lowbit.kernels import moe_op
    from tests.kernels.cases import make_weight

    e, h, i, a = 128, 64, 32, 8
    w13, w2 = make_weight(case, 2 * i, h, lead=(e,)), make_weight(case, h, i, lead=(e,))
    ids = torch.randint(0, e, (t, a), dtype=torch.int32)
    call = moe_op.MoeCall(torch.randn(t, h).bfloat16(), ids, torch.rand(t, a), w13, w2, forced=True)
    reason = moe_op._admit_decode(call)
    if want is None:
        assert reason is not None and "tokens" in reason
        return
    assert reason is None
    ran = []
    monkeypatch.setattr(moe_op, "fused_moe_gemv", lambda *a, **k: ran.append("gemv"))
    monkeypatch.setattr(moe_op, "fused_moe", lambda *a, **k: ran.append("tiles"))
    moe_op._run("decode")(call)
    assert ran == [want]


def test_prefer_makes_a_route_the_first_choice(op):
    """Op.prefer (bench variants, scripts/with_route.py): the route gets DEFAULT status and the
    DEFAULT routes ahead of it step aside, so the calls it admits take it and the others fall
    through to the routes after it."""
    entry = routes.ops()[op]
    was = {r.name: r.status for r in entry.routes}
    try:
        entry.prefer("slow")
        assert {r.name: r.status for r in entry.routes} == {
            "small": OPT_IN, "fancy": OPT_IN, "slow": DEFAULT, "torch": DEFAULT}
        assert routes.select(op, Call(4)).name == "slow"
        for r in entry.routes:
            r.status = was[r.name]
        entry.prefer("fancy")  # small steps aside; odd sizes fall through to the reference
        assert routes.select(op, Call(4)).name == "fancy" and routes.select(op, Call(3)).name == "torch"
    finally:
        for r in entry.routes:
            r.status = was[r.name]


def test_a_launch_config_overlay_comes_first_and_a_bad_one_is_refused(monkeypatch, tmp_path, caplog):
    """LOWBIT_LAUNCH_CONFIGS names a tuner's output: its shapes and choices win over the device
    file's, shapes it lacks fall through, and a missing or table-less file is an error."""
    from lowbit.kernels import launch

    device = {"tc_gemv": {"nvfp4:64x32": {"1": {"BN": 64}, "8": {"BN": 128}}, "nvfp4:16x32": {"1": {"BN": 16}}},
              "choice": {"nf4:64x32": {"1": "gemv"}}}
    monkeypatch.setattr(launch, "_file", lambda name: device if name == "cpu" else {})
    monkeypatch.setattr(launch, "_device_file", lambda name: name)
    tuned = tmp_path / "tc_tuned.json"
    tuned.write_text(json.dumps({"device": "cpu", "tc_gemv": {"nvfp4:64x32": {"1": {"BN": 32, "WAVES": 2}}},
                                 "choice": {"nf4:64x32": {"1": "gemm"}}, "ab": [{"kernel": "x"}]}))
    assert launch.lookup("tc_gemv", "nvfp4", 64, 32, 1, device="cpu") == {"BN": 64}
    monkeypatch.setenv(launch.OVERLAY_ENV, str(tuned))
    launch.overlay_file.cache_clear()
    with caplog.at_level("WARNING", logger="lowbit"):
        assert launch.lookup("tc_gemv", "nvfp4", 64, 32, 1, device="cpu") == {"BN": 32, "WAVES": 2}
    assert "its launch configs (tc_gemv) come before the shipped ones" in caplog.text  # said once, not silent
    assert launch.lookup("tc_gemv", "nvfp4", 64, 32, 3, device="cpu") == {"BN": 32, "WAVES": 2}  # its largest bucket
    assert launch.lookup("tc_gemv", "nvfp4", 16, 32, 1, device="cpu") == {"BN": 16}  # not in the overlay
    assert launch.choice("nf4", 64, 32, 1, device="cpu") == "gemm"
    assert "under the overlay" in launch.config_status("cpu")
    for text, why in (("{not json", "not a readable JSON"), ('{"device": "x", "ab": []}', "no kernel tables")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        monkeypatch.setenv(launch.OVERLAY_ENV, str(bad))
        launch.overlay_file.cache_clear()
        with pytest.raises(LowbitError, match=why):
            launch.lookup("tc_gemv", "nvfp4", 64, 32, 1, device="cpu")
    monkeypatch.setenv(launch.OVERLAY_ENV, str(tmp_path / "absent.json"))
    with pytest.raises(LowbitError, match="absent.json: not a readable"):
        launch.lookup("tc_gemv", "nvfp4", 64, 32, 1, device="cpu")
    launch.overlay_file.cache_clear()
