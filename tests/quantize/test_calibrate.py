"""`lowbit quantize --calib`: Hessians from calibration text, GPTQ artifacts, refusals."""

import json

import pytest
import torch

from lowbit.cli import main
from lowbit.errors import LowbitError
from lowbit.quantize.calibrate import MIN_TOKENS, Calibration, HessianSums

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 40


def test_rarely_routed_experts_take_the_pooled_hessian():
    sums = HessianSums()
    sums.h["w13"] = torch.zeros(3, 4, 4)
    sums.n["w13"] = torch.zeros(3, dtype=torch.long)
    x = torch.randn(100, 4)
    sums.add("w13", x[:60], 0)
    sums.add("w13", x[60:60 + MIN_TOKENS - 1], 1)  # too few: pooled; expert 2 sees none
    h = sums.mean("w13")
    pooled = x[:60 + MIN_TOKENS - 1].T @ x[:60 + MIN_TOKENS - 1] / (60 + MIN_TOKENS - 1)
    assert torch.allclose(h[0], x[:60].T @ x[:60] / 60, atol=1e-5)
    assert torch.allclose(h[1], pooled, atol=1e-5) and torch.allclose(h[2], pooled, atol=1e-5)


def test_calibration_file_refusals(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("  \n")
    for name, msg in (("none.txt", "no such file"), ("latin1.txt", "not UTF-8"), ("empty.txt", "empty")):
        with pytest.raises(LowbitError, match=msg):
            Calibration.read(tmp_path / name)
    with pytest.raises(LowbitError, match="not a file"):
        Calibration.read(tmp_path)


def test_bad_calib_fails_before_the_model_loads(tmp_path, capsys):
    (tmp_path / "calib.txt").write_text(TEXT)
    cases = [(["quantize", str(tmp_path / "no-model"), "--format", "nf4", "--out", str(tmp_path / "a"),
               "--calib", str(tmp_path / "missing.txt")], "--calib"),
             (["quantize", str(tmp_path / "no-model"), "--format", "fp8", "--out", str(tmp_path / "b"),
               "--calib", str(tmp_path / "calib.txt")], "scalar formats")]
    for argv, msg in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and err.strip().count("\n") == 0, err


def test_calib_flag_writes_a_gptq_artifact_that_generates(tiny_moe_dir, tmp_path, capsys):
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    art = tmp_path / "art"
    argv = ["quantize", str(tiny_moe_dir), "--format", "nvfp4", "--out", str(art), "--device", "cpu",
            "--calib", str(calib)]
    assert main(argv) == 0
    assert "gptq" in capsys.readouterr().out
    rounding = json.loads((art / "lowbit.json").read_text())["provenance"]["rounding"]
    assert rounding["method"] == "gptq" and rounding["damp"] == 0.01
    assert rounding["calibration"]["sha256"] == Calibration.read(calib).sha256
    assert rounding["calibration"]["tokens"] > 100 and rounding["weights"]["gptq"] > 0
    assert rounding["weights"]["nearest"] == 0  # every planned weight saw calibration inputs
    assert main(["generate", str(art), "It is a truth", "--max-tokens", "4", "--ignore-eos"]) == 0
    plain = tmp_path / "plain"
    assert main(["quantize", str(tiny_moe_dir), "--format", "nvfp4", "--out", str(plain), "--device", "cpu"]) == 0
    assert "rounding" not in json.loads((plain / "lowbit.json").read_text())["provenance"]


def test_unreached_weights_keep_nearest_rounding():
    from lowbit.checkpoint.quant_plan import QuantPlan
    from lowbit.formats import get_format
    from lowbit.layers.linear import Linear
    from lowbit.quantize.calibrate import calibrated_quantize

    model = torch.nn.Module()
    model.proj = Linear(64, 16)
    model.proj.weight.data.normal_()
    w = model.proj.weight.data.clone()
    fmt = get_format("nf4")
    counts = calibrated_quantize(model, QuantPlan({"proj.weight": fmt}), HessianSums())
    assert counts == {"gptq": 0, "nearest": 1, "expert_matrices_pooled": 0}
    assert torch.equal(model.proj.weight.dequantize(), fmt.quantize(w).dequantize())


def test_sequential_rounding_calibrates_each_layer_on_the_rounded_layers_before_it(tiny_moe_dir):
    """--sequential: layer 0's weights get the dense model's Hessians; layer 1's get those of
    the model whose layer 0 is already rounded (checked against a model rounded by hand),
    which differ from the dense ones; each group's pass stops after its decoder layer."""
    from lowbit.checkpoint.loader import load_model
    from lowbit.checkpoint.quant_plan import QuantPlan, plan_quantization, swappable
    from lowbit.layers.linear import set_quantized
    from lowbit.quantize.allocate import round_weight
    from lowbit.quantize.calibrate import collect_hessians, round_sequentially, sequential_groups

    def fresh():
        return load_model(tiny_moe_dir, dtype="float32", device="cpu").model

    model = fresh()
    plan = plan_quantization(model, "nf4", False)
    torch.manual_seed(0)
    ids = torch.randint(3, 200, (300,)).tolist()
    groups = sequential_groups(model, list(plan.quantized))
    assert [g[0].split(".self_attn")[0].split(".mlp")[0] for g in groups] == [
        "model.layers.0", "model.layers.0", "model.layers.1", "model.layers.1"]
    assert all("attn" in n for n in groups[0]) and not any("attn" in n for n in groups[1])
    seen, calls = {}, []
    model.model.layers[1].register_forward_hook(lambda *_: calls.append(1))

    def record(f, w, h):
        seen[pname_of[w.data_ptr()]] = None if h is None else h.clone()
        return round_weight(f, w, h, 0.01)

    pname_of = {getattr(m, a).data_ptr(): n for n, (m, a) in swappable(model).items()}
    counts = round_sequentially(model, plan.quantized, ids, "cpu", 256, record)
    assert counts["groups"] == 4 and set(seen) == set(plan.quantized)
    assert len(calls) == 2 * 2  # windows of at most 256 tokens: 2 passes through layer 1, for its 2 groups

    dense = fresh()
    sums = collect_hessians(dense, plan, ids, "cpu", 256)
    q = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(seen[q], sums.mean(q))  # nothing rounded before layer 0
    by_hand = fresh()
    targets = swappable(by_hand)
    for n in groups[0] + groups[1]:  # layer 0 rounded as the sequential run rounded it
        m, a = targets[n]
        set_quantized(m, a, round_weight(plan.quantized[n], getattr(m, a).data, seen[n], 0.01))
    later = [n for n in groups[2] if n.endswith("q_proj.weight")][0]
    want = collect_hessians(by_hand, QuantPlan({later: plan.quantized[later]}), ids, "cpu", 256).mean(later)
    torch.testing.assert_close(seen[later], want)
    assert not torch.allclose(seen[later], sums.mean(later))  # the rounded layer 0 changed its inputs


def test_sequential_needs_calib(tmp_path, capsys):
    argv = ["quantize", str(tmp_path / "no-model"), "--format", "nf4", "--out", str(tmp_path / "a"), "--sequential"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--sequential" in err and "--calib" in err and "Traceback" not in err, err

