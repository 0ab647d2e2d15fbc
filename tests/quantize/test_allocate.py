"""`lowbit quantize --bpw`: the byte-budget allocator, its refusals, and the artifact it plans."""

import json
import math

import pytest
import torch

from lowbit.checkpoint.artifact import bytes_by_format
from lowbit.checkpoint.loader import load_model
from lowbit.checkpoint.quant_plan import plan_quantization
from lowbit.checkpoint.tokenizer import Tokenizer
from lowbit.cli import main
from lowbit.errors import LowbitError
from lowbit.formats import get_format
from lowbit.quantize.allocate import Candidate, TensorChoices, allocate, kernel_family, proxy_error
from lowbit.quantize.calibrate import collect_hessians

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 40


def synthetic(seed: int = 0, n: int = 40) -> list[TensorChoices]:
    """Tensors of random sizes, each with 4 formats whose error falls as the bytes rise."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        weights = int(torch.randint(256, 8192, (), generator=g)) * 8
        scale = float(torch.rand((), generator=g)) * 10 + 0.1
        cands = [Candidate(f"f{b}", weights * b // 8 + int(torch.randint(0, 64, (), generator=g)),
                           scale * 4.0 ** -b) for b in (2, 3, 4, 8)]
        out.append(TensorChoices(f"t{i:02d}", weights, cands))
    return out


def totals(tensors, chosen):
    w = sum(t.weights for t in tensors)
    return w, sum(c.nbytes for c in chosen.values()), sum(c.error for c in chosen.values())


def test_budget_holds_by_bytes_and_more_budget_never_costs_error():
    tensors = synthetic()
    last = math.inf
    for bpw in [2.1 + 0.1 * i for i in range(60)]:
        chosen = allocate(tensors, bpw)
        w, b, err = totals(tensors, chosen)
        assert 8 * b <= bpw * w, (bpw, 8 * b / w)
        assert err <= last + 1e-12, bpw
        last = err
        if 2.2 <= bpw <= 7.8:  # fine-grained candidates: the allocation uses the budget
            assert 8 * b >= 0.99 * bpw * w, (bpw, 8 * b / w)


def test_allocation_is_deterministic_and_prefers_sensitive_tensors():
    tensors = synthetic(1)
    assert allocate(tensors, 3.5) == allocate(tensors, 3.5)
    chosen = allocate(tensors, 3.5)
    by_scale = sorted(tensors, key=lambda t: t.candidates[0].error / t.weights)
    bits = [8 * chosen[t.name].nbytes / t.weights for t in by_scale]
    assert sum(bits[-10:]) > sum(bits[:10])  # the most sensitive quarter gets more bits



def test_a_layers_expert_stacks_share_a_kernel_family():
    """w13 / w2 of one layer: both vector-codebook formats or neither (the GPU MoE routes read
    one family a layer), while unpaired tensors choose freely; the pairs' bytes and errors are
    the members' own, and the budget still holds."""
    def stack(name, vq_err, lut_err, weights=4096):
        # vq3 is cheap and good for this tensor, nf4 dearer; vq4 / nf3 the other way round
        return TensorChoices(name, weights, [
            Candidate("vq3", weights * 13 // 32, vq_err), Candidate("nf4", weights * 17 // 32, lut_err),
            Candidate("nf3", weights * 13 // 32, lut_err * 1.5), Candidate("vq4", weights * 17 // 32, vq_err * 0.5)])
    tensors = [stack("layers.0.mlp.experts.w13", 1.0, 5.0), stack("layers.0.mlp.experts.w2", 5.0, 1.0),
               stack("layers.1.mlp.experts.w13", 1.0, 5.0), stack("layers.1.q_proj.weight", 1.0, 5.0),
               stack("layers.1.o_proj.weight", 5.0, 1.0)]
    free = {t.name: min(t.candidates[:1] + t.candidates[2:3], key=lambda c: c.error).format for t in tensors}
    assert free["layers.0.mlp.experts.w13"] == "vq3" and free["layers.0.mlp.experts.w2"] == "nf3"  # mixed if free
    chosen = allocate(tensors, 3.25)
    w13, w2 = chosen["layers.0.mlp.experts.w13"], chosen["layers.0.mlp.experts.w2"]
    assert kernel_family(w13.format) == kernel_family(w2.format), (w13, w2)
    assert chosen["layers.1.q_proj.weight"].format == "vq3" and chosen["layers.1.o_proj.weight"].format == "nf3"
    assert chosen["layers.1.mlp.experts.w13"].format == "vq3"  # no w2 in that layer: unpaired
    by = {t.name: {c.format: c for c in t.candidates} for t in tensors}
    assert all(c == by[n][c.format] for n, c in chosen.items())  # members' own bytes and errors
    assert 8 * sum(c.nbytes for c in chosen.values()) <= 3.25 * sum(t.weights for t in tensors)
    assert [kernel_family(f) for f in ("vq2", "vq3", "vq4", "nf4", "nvfp4", "fp8", "dense")] == ["vq"] * 3 + ["lut"] * 4
    free = allocate(tensors, 3.25, "free")  # each stack alone: layer 0 mixes the families
    assert (free["layers.0.mlp.experts.w13"].format, free["layers.0.mlp.experts.w2"].format) == ("vq3", "nf3")
    assert sum(c.error for c in free.values()) < sum(c.error for c in chosen.values())
    with pytest.raises(LowbitError, match="--expert-pairs any: give one of family, free"):
        allocate(tensors, 3.25, "any")
    with pytest.raises(LowbitError, match="no candidate pair of one kernel family"):
        allocate([TensorChoices("e.w13", 64, [Candidate("vq3", 26, 1.0)]),
                  TensorChoices("e.w2", 64, [Candidate("nf4", 34, 1.0)])], 8.0)


def test_budget_below_the_cheapest_candidates_is_a_sentence():
    with pytest.raises(LowbitError, match=r"cheapest candidates \(f2\) already take 2\.\d+ bits"):
        allocate(synthetic(), 1.5)


def test_proxy_error_weights_the_error_by_the_hessian():
    w = torch.randn(2, 8, 64)
    qt = get_format("nf3").quantize(w)
    d = w - qt.dequantize(torch.float32)
    assert proxy_error(w, qt, None) == pytest.approx(float(d.pow(2).sum()), rel=1e-5)
    x = torch.randn(2, 100, 64)
    h = x.transpose(1, 2) @ x  # [E, K, K]
    want = sum(float(torch.trace(d[e] @ h[e] @ d[e].T)) for e in range(2))
    assert proxy_error(w, qt, h) == pytest.approx(want, rel=1e-4)


def test_expert_errors_are_weighted_by_their_share_of_the_output(tiny_moe_dir):
    m = load_model(tiny_moe_dir, dtype="float32", device="cpu")
    ids = Tokenizer(tiny_moe_dir).encode(TEXT)
    sums = collect_hessians(m.model, plan_quantization(m.model, "nf4"), ids, "cpu",
                            m.config.max_position_embeddings)
    assert sums.tokens == len(ids)
    for name in sums.g2:
        share = sums.output_weight(name)  # [E] mean g^2 per token
        assert share.shape == (4,) and bool((share >= 0).all())
        assert 0 < float(share.sum()) <= 1 + 1e-6  # routing weights of a token sum to at most 1
    w = torch.randn(4, 8, 64)
    qt = get_format("nf3").quantize(w)
    per = (w - qt.dequantize(torch.float32)).pow(2).sum((1, 2))
    share = torch.tensor([0.5, 0.25, 0.0, 0.1], dtype=torch.float64)
    assert proxy_error(w, qt, None, share) == pytest.approx(float((per.double() * share).sum()), rel=1e-6)


def test_bpw_with_format_or_formats_alone_is_refused(tmp_path, capsys):
    cases = [(["--format", "nf4", "--bpw", "4"], "--bpw chooses a format per weight"),
             (["--formats", "nf4,nf3"], "--formats lists the candidates of --bpw"),
             ([], "give --format F"),
             (["--bpw", "4", "--formats", "nf4,nope"], "nope"),
             (["--format", "nf4", "--expert-pairs", "free"], "--expert-pairs is how --bpw plans")]
    for flags, msg in cases:
        assert main(["quantize", str(tmp_path / "no-model"), "--out", str(tmp_path / "a"), *flags]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and err.strip().count("\n") == 0, err


@pytest.mark.parametrize("calib", [False, True])
def test_bpw_artifact_stores_the_planned_bytes_and_generates(tiny_moe_dir, tmp_path, capsys, calib):
    art = tmp_path / "art"
    argv = ["quantize", str(tiny_moe_dir), "--bpw", "6", "--formats", "nvfp4,nf4,fp8", "--out", str(art),
            "--device", "cpu", "--sensitivity", "proxy"]
    if calib:
        (tmp_path / "calib.txt").write_text(TEXT)
        argv += ["--calib", str(tmp_path / "calib.txt")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "total" in out and "(budget 6.0)" in out
    manifest = json.loads((art / "lowbit.json").read_text())
    plan = manifest["allocation"]
    assert plan["bpw_budget"] == 6 and 8 * plan["bytes"] <= 6 * plan["weights"]
    assert "one kernel family" in plan["expert_pairs"]
    assert plan["sensitivity"]["method"] == "proxy"  # asked for: kl is the default with --calib
    assert plan["sensitivity"]["error"].startswith("trace" if calib else "||W-Q||")
    assert len({e["format"] for e in plan["tensors"].values()}) >= 2  # a real mix at 6 bits
    for name, e in plan["tensors"].items():
        assert manifest["tensors"][name]["format"] == e["format"]
        assert manifest["tensors"][name]["bits_per_weight"] == pytest.approx(e["bits"], abs=1e-5)
    stored = bytes_by_format(art)
    q = {f: v for f, v in stored.items() if f in {"nvfp4", "nf4", "fp8"}}
    assert sum(b for _, b in q.values()) == plan["bytes"]  # every stored payload byte, as planned
    assert sum(n for n, _ in q.values()) == plan["weights"]
    assert main(["generate", str(art), "hello", "--max-tokens", "3", "--device", "cpu"]) == 0
