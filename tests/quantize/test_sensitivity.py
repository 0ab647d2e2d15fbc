"""`lowbit quantize --bpw B --sensitivity kl`: the measured KL probe, its ranking, and the plan it records."""

import json

import pytest
import torch

from lowbit.checkpoint.loader import load_model
from lowbit.checkpoint.quant_plan import swappable
from lowbit.checkpoint.tokenizer import Tokenizer
from lowbit.cli import main
from lowbit.formats import get_format
from lowbit.quantize.allocate import allocate, tensor_choices
from lowbit.quantize.sensitivity import KLProbe

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small ops: one thread (conftest)

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 40
BROKEN = "model.layers.1.self_attn.v_proj.weight"


@pytest.fixture(scope="module")
def tiny(tiny_moe_dir):
    m = load_model(tiny_moe_dir, dtype="float32", device="cpu")
    ids = Tokenizer(tiny_moe_dir).encode(TEXT)
    return m, KLProbe.build(m.model, ids, "cpu", tokens=256, window=64)


def test_probe_starts_at_the_weights_layer_and_restores_it(tiny):
    m, probe = tiny
    assert probe.kl() == pytest.approx(0, abs=1e-7) and len(probe.x) == 256
    mod, attr = swappable(m.model)["model.layers.1.mlp.experts.w2"]
    w = getattr(mod, attr).data.clone()
    qt = get_format("nf3").quantize(w)
    d = probe.delta_kl(mod, attr, qt)
    assert d > 0 and torch.equal(getattr(mod, attr).data, w)
    getattr(mod, attr).data = qt.dequantize(torch.float32)
    try:
        assert probe.kl() == pytest.approx(d, rel=1e-4)  # the full pass from layer 0 agrees
    finally:
        getattr(mod, attr).data = w


def test_a_broken_weight_ranks_most_sensitive(tiny):
    """Every weight in nf4 except one whose payload is wrecked: the probe puts it first."""
    m, probe = tiny
    targets = swappable(m.model)
    errors = {}
    for name, (mod, attr) in targets.items():
        w = getattr(mod, attr).data
        bad = w + 3 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
        errors[name] = probe.delta_kl(mod, attr, get_format("nf4").quantize(bad if name == BROKEN else w))
    assert max(errors, key=errors.get) == BROKEN
    assert sorted(errors.values())[-2] < 0.5 * errors[BROKEN], errors


def test_measured_choices_fit_the_budget_and_favour_sensitive_weights(tiny):
    m, probe = tiny
    formats = [get_format(f) for f in ("nf3", "nf4", "fp8")]
    choices, _ = tensor_choices(m.model, formats, None, 0.01, probe=probe, dense_bits=16)
    assert {c.format for c in choices[0].candidates} == {"nf3", "nf4", "fp8", "dense"}
    for t in choices:
        kl = {c.format: c.error for c in t.candidates}
        assert kl["dense"] == 0 and kl["nf3"] > kl["fp8"] >= 0
    w = sum(t.weights for t in choices)
    cheapest = 8 * sum(min(c.nbytes for c in t.candidates) for t in choices) / w
    worst = max(choices, key=lambda t: t.candidates[0].error)  # the largest nf3 KL increase
    for bpw in (cheapest + 0.5, cheapest + 1, cheapest + 3, 16):
        chosen = allocate(choices, bpw)
        assert 8 * sum(c.nbytes for c in chosen.values()) <= bpw * w
        assert chosen[worst.name].format != "nf3"  # the first weight to get more bits
    assert all(c.format == "dense" for c in allocate(choices, 16).values())  # no error left at 16 bits


def test_kl_plan_is_recorded_and_checked_against_its_measured_kl(tiny_moe_dir, tmp_path, capsys):
    (tmp_path / "calib.txt").write_text(TEXT)
    art = tmp_path / "art"
    argv = ["quantize", str(tiny_moe_dir), "--bpw", "11", "--formats", "nf4,fp8,dense", "--out", str(art),
            "--device", "cpu", "--calib", str(tmp_path / "calib.txt")]
    assert main(argv) == 0  # --sensitivity kl is the default with --calib
    assert "sensitivity kl: plan KL" in capsys.readouterr().out
    manifest = json.loads((art / "lowbit.json").read_text())
    plan = manifest["allocation"]
    s = plan["sensitivity"]
    assert s["method"] == "kl" and s["tokens"] > 0 and s["plan_kl_measured"] > 0
    assert s["plan_kl_predicted"] == pytest.approx(sum(e["error"] for e in plan["tensors"].values()))
    assert 8 * plan["bytes"] <= 11 * plan["weights"] and plan["formats"] == ["nf4", "fp8", "dense"]
    assert set(plan["candidates"]) == set(plan["tensors"])
    kept = [n for n, e in plan["tensors"].items() if e["format"] == "dense"]
    assert kept and all("kept dense by the --bpw plan" in manifest["dense"][n] for n in kept)
    assert all(plan["tensors"][n]["bits"] == 16 for n in kept)
    for n, e in plan["tensors"].items():
        if e["format"] != "dense":
            assert manifest["tensors"][n]["format"] == e["format"]
    assert main(["generate", str(art), "hello", "--max-tokens", "3", "--device", "cpu"]) == 0

    again = tmp_path / "again"  # another budget from the same scores: nothing is measured again
    assert main([*argv[:3], "9.5", "--formats", "fp8,nf4", "--out", str(again), "--device", "cpu",
                 "--calib", str(tmp_path / "calib.txt"), "--sensitivity-from", str(art)]) == 0
    assert "sensitivity 1/" not in capsys.readouterr().err
    plan2 = json.loads((again / "lowbit.json").read_text())["allocation"]
    assert plan2["sensitivity"]["scores_from"] == str(art) and plan2["sensitivity"]["method"] == "kl"
    assert 8 * plan2["bytes"] <= 9.5 * plan2["weights"]
    for n, e in plan2["tensors"].items():
        assert e["error"] == plan["candidates"][n][e["format"]][1]
    (tmp_path / "other.txt").write_text(TEXT + "More.")
    assert main([*argv[:-1], str(tmp_path / "other.txt"), "--sensitivity-from", str(art)]) == 2
    assert "its scores come from other weights, calibration text or --damp" in capsys.readouterr().err


def test_sensitivity_refusals(tiny_moe_dir, tmp_path, capsys):
    cases = [(["--bpw", "4", "--sensitivity", "kl"], "--sensitivity kl measures on the calibration text"),
             (["--format", "nf4", "--sensitivity", "proxy"], "--sensitivity scores the candidates of --bpw")]
    for flags, msg in cases:
        assert main(["quantize", str(tiny_moe_dir), "--out", str(tmp_path / "a"), *flags]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, err
