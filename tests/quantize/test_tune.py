"""`lowbit quantize --tune-scales`: block scales tuned on the teacher's KL, same payload bytes."""

import json

import pytest
import torch

from lowbit.cli import main
from lowbit.formats import get_format
from lowbit.quantize.tune import Target, _Block, _Grid, tunable

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife. However little known the feelings or views of such a man may be. ") * 30


@pytest.mark.parametrize("name", ["nf4", "nf3", "lut4", "lut3", "vq4", "vq2"])
def test_unit_scale_decode_times_scales_is_the_decode(name):
    """What tuning relies on: w = (decode with unit scales) * block scale, exactly, padding included."""
    torch.manual_seed(0)
    w = torch.randn(2, 24, 100) * 0.05  # K = 100: the last block is padded
    qt = get_format(name).quantize(w)
    assert tunable(qt)
    holder = torch.nn.Module()
    b = _Block(holder, "w", qt)
    b.install(stored=True)
    assert torch.equal(holder.w, qt.dequantize())
    b.best = torch.full_like(b.s, 0.1)
    b.finish()
    tuned = holder.w
    assert torch.equal(tuned.payload["codes"], qt.payload["codes"]) and tuned.nbytes == qt.nbytes
    assert torch.allclose(tuned.dequantize(), qt.dequantize() * torch.exp(torch.tensor(0.1)), rtol=1e-2)


@pytest.mark.parametrize("name", ["nf4", "nf3", "lut4", "lut3", "vq4", "vq3", "vq2"])
def test_latent_codes_start_at_the_rounding_and_store_what_they_decode(name):
    """With codes: Q(v) at the start is the rounding (same decode); after the latent moves, the
    stored payload decodes to exactly what the check installed, with the same bytes."""
    torch.manual_seed(1)
    w = torch.randn(2, 24, 100) * 0.05  # K = 100: padded, a whole number of vq groups
    qt = get_format(name).quantize(w)
    holder = torch.nn.Module()
    b = _Block(holder, "w", qt, codes=True)
    assert b.grid is not None
    b.install(stored=True)
    assert torch.equal(holder.w, qt.dequantize())
    with torch.no_grad():
        b.v += 0.3 * torch.randn_like(b.v)
        b.t += 0.05
    b.install(stored=True)
    seen = holder.w.clone()
    assert not torch.equal(seen, qt.dequantize())
    b.keep()
    assert b.changed() > 0
    b.finish()
    tuned = holder.w
    assert tuned.nbytes == qt.nbytes and tuned.payload["codes"].shape == qt.payload["codes"].shape
    assert torch.equal(tuned.dequantize(), seen)


def test_latent_codes_get_the_straight_through_gradient():
    torch.manual_seed(2)
    qt = get_format("vq4").quantize(torch.randn(8, 64))
    holder = torch.nn.Module()
    b = _Block(holder, "w", qt, codes=True)
    b.install(stored=False)
    x = torch.randn(5, 64)
    (x @ holder.w.t()).square().sum().backward()
    g_w = 2 * ((x @ qt.dequantize().t()).t() @ x)  # d/dw of the same loss, [8, 64]
    assert torch.allclose(b.v.grad.flatten(-2), g_w * b.s.repeat_interleave(64, -1), rtol=1e-4, atol=1e-4)
    assert b.t.grad is not None and b.t.grad.abs().sum() > 0


def test_vq_weights_with_a_split_group_keep_their_codes():
    qt = get_format("vq2").quantize(torch.randn(4, 30))  # D = 4: the last group straddles the padding
    b = _Block(torch.nn.Module(), "w", qt, codes=True)
    assert b.grid is None and not hasattr(b, "v")  # no latent weights: the scales alone are tuned
    assert _Block(torch.nn.Module(), "w", get_format("nf4").quantize(torch.randn(4, 30)), codes=True).grid is not None


@pytest.mark.parametrize("m", [4, 32])
@pytest.mark.parametrize("book", ["vq3", "vq2", "vq4", "random"])
def test_neighbour_search_finds_what_the_full_search_finds(book, m, monkeypatch):
    """The warm-started vq search (current entry, its m neighbours, then all C) against the full
    search and an exact float64 one, latents moved from their entries by small to large steps;
    a group is counted wrong only if its entry is farther than the exact nearest (a tie)."""
    gen = torch.Generator().manual_seed(3)
    cb = get_format(book).codebook.float() if book != "random" else torch.randn(512, 3, generator=gen)
    monkeypatch.setattr(_Grid, "NEIGHBOURS", m)
    grid = _Grid(None, None, cb)
    searched = []
    full = grid.full
    monkeypatch.setattr(grid, "full", lambda x: searched.append(len(x)) or full(x))
    g = 3000
    idx = torch.randint(len(cb), (g,), generator=gen)
    for move in (0.0, 0.05, 0.15, 0.3, 0.6, 2.0):  # alone / 2 is about 0.1-0.3, reach 0.4-1.5
        x = cb[idx] + move * torch.randn(g, cb.shape[1], generator=gen)
        searched.clear()
        got = grid.local(x, idx)
        ref = torch.cdist(x.double(), cb.double()).argmin(-1)
        err = ((x.double() - cb[got].double()).pow(2).sum(-1) - (x.double() - cb[ref].double()).pow(2).sum(-1))
        assert err.max() <= 1e-6, (move, int((err > 1e-6).sum()))
        assert (got == full(x)).float().mean() > 0.999
        if move == 0.0:
            assert torch.equal(got, idx) and not searched  # nobody moved: no search at all
        if move == 0.05:
            assert sum(searched) < g // 10  # small moves rarely need the full search
        if move == 2.0:
            assert sum(searched) > 0  # large ones do
        idx = got


def _teacher_student(t: int = 48, v: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """Peaked next-token log-probabilities [t, v] of a teacher, and student logits near it."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(t, v, generator=g) * 4
    return z.log_softmax(-1), (z + 0.5 * torch.randn(t, v, generator=g)).requires_grad_()


def _kl_and_grad(target: Target, zq: torch.Tensor) -> tuple[float, torch.Tensor]:
    loss = target.kl(zq.log_softmax(-1))
    return loss.item(), torch.autograd.grad(loss, zq)[0]


@pytest.mark.parametrize("k", [999, 1000])
def test_topk_teacher_kl_is_the_full_kl_when_it_leaves_at_most_one_token(k):
    logp, zq = _teacher_student()
    full, grad = _kl_and_grad(Target.of(logp, 0), zq)
    top, top_grad = _kl_and_grad(Target.of(logp, k), zq)
    assert top == pytest.approx(full, rel=1e-5) and torch.allclose(top_grad, grad, atol=1e-8)


@pytest.mark.parametrize("k,cos", [(8, 0.98), (64, 0.9995), (128, 0.99999)])
def test_topk_teacher_kl_bounds_the_full_kl_and_its_gradient_agrees(k, cos):
    logp, zq = _teacher_student()
    full, grad = _kl_and_grad(Target.of(logp, 0), zq)
    top, top_grad = _kl_and_grad(Target.of(logp, k), zq)
    assert 0 < top <= full
    assert torch.nn.functional.cosine_similarity(top_grad.flatten(), grad.flatten(), 0) > cos


def test_topk_teacher_stores_8k_plus_4_bytes_a_token_and_concatenates():
    logp, _ = _teacher_student(t=48, v=1000)
    assert Target.of(logp, 0).nbytes == 48 * 1000 * 4 == Target.of(logp, 5000).nbytes
    parts = [Target.of(logp[:16], 64), Target.of(logp[16:], 64)]
    joined, whole = Target.cat(parts), Target.of(logp, 64)
    assert joined.nbytes == whole.nbytes == 48 * (64 * 8 + 4)
    assert torch.equal(joined.ids, whole.ids) and torch.equal(joined.tail, whole.tail)


def test_formats_without_bf16_block_scales_are_not_tuned():
    w = torch.randn(8, 64)
    for name in ("nvfp4", "int4", "fp8", "mxfp4"):
        assert not tunable(get_format(name).quantize(w))
    assert not tunable(w)


def test_tune_scales_needs_calib_and_steps(tiny_moe_dir, tmp_path, capsys):
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    base = ["quantize", str(tiny_moe_dir), "--out", str(tmp_path / "a"), "--device", "cpu"]
    for extra, msg in ((["--format", "nf4", "--tune-scales", "10"], "--calib"),
                       (["--format", "nf4", "--calib", str(calib), "--tune-scales", "-1"], "number of tuning steps"),
                       (["--format", "nf4", "--calib", str(calib), "--tune-text", str(calib)], "--tune-scales STEPS"),
                       (["--format", "nvfp4", "--calib", str(calib), "--tune-scales", "10"], "has none"),
                       (["--format", "nf4", "--calib", str(calib), "--tune-norms"], "--tune-scales STEPS too"),
                       (["--format", "nf4", "--calib", str(calib), "--tune-codes"], "--tune-scales STEPS too"),
                       (["--format", "nf4", "--calib", str(calib), "--tune-scales", "5", "--tune-codes", "-0.1"],
                        "Adam's rate"),
                       (["--format", "nf4", "--calib", str(calib), "--tune-schedule", "cosine"],
                        "--tune-scales STEPS too"),
                       (["--format", "nf4", "--calib", str(calib), "--tune-teacher-topk", "64"],
                        "--tune-scales STEPS too"),
                       (["--format", "nf4", "--calib", str(calib), "--tune-scales", "10", "--tune-teacher-topk", "-1"],
                        "or 0 for all")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, err


@pytest.mark.parametrize("codes", [None, "0.01"])
def test_tuned_artifact_lowers_validation_kl_keeps_bytes_and_generates(tiny_moe_dir, tmp_path, capsys, codes):
    """Scales alone, and with --tune-codes the codes too: same bytes, a lower validation KL."""
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    plain, tuned = tmp_path / "plain", tmp_path / "tuned"
    args = ["quantize", str(tiny_moe_dir), "--format", "nf3", "--device", "cpu", "--calib", str(calib)]
    assert main(args + ["--out", str(plain)]) == 0
    assert main(args + ["--out", str(tuned), "--tune-scales", "50"] + (["--tune-codes", codes] if codes else [])) == 0
    out = capsys.readouterr().out
    assert "tune-scales" in out and ("codes changed" in out) == bool(codes)
    m_plain, m_tuned = (json.loads((p / "lowbit.json").read_text()) for p in (plain, tuned))
    rec = m_tuned["provenance"]["rounding"]["tuning"]
    assert rec["validation_kl_after"] < rec["validation_kl_before"] and rec["kept_step"] > 0
    assert rec["weights"] == m_tuned["totals"]["quantized_tensors"] and rec["validation_windows"] >= 1
    if codes:
        assert rec["method"] == "block scales and codes tuned on the teacher's KL" and rec["codes_lr"] == 0.01
        assert rec["codes_changed"] > 0 and rec["code_weights"] == rec["weights"]
    else:
        assert rec["method"] == "block scales tuned on the teacher's KL" and "codes_changed" not in rec
    assert m_tuned["totals"]["bytes_after"] == m_plain["totals"]["bytes_after"]
    assert main(["generate", str(tuned), "It is a truth", "--max-tokens", "4", "--ignore-eos"]) == 0


def test_bpw_plan_is_tuned_after_allocation_within_its_bytes(tiny_moe_dir, tmp_path, monkeypatch):
    """A --bpw plan tuned with norms and a cosine schedule (the rate of step s of S is
    LR (1 + cos(pi (s - 1) / (S - 1))) / 2: the full rate first, 0 last)."""
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    art = tmp_path / "art"
    rates, step = [], torch.optim.Adam.step

    def spy(self, *a, **kw):
        rates.append(self.param_groups[0]["lr"])
        return step(self, *a, **kw)

    monkeypatch.setattr(torch.optim.Adam, "step", spy)
    argv = ["quantize", str(tiny_moe_dir), "--bpw", "7.6", "--formats", "nf3,nf4,fp8", "--out", str(art),
            "--device", "cpu", "--calib", str(calib), "--tune-scales", "25", "--tune-norms", "--tune-teacher-topk", "8",
            "--tune-schedule", "cosine"]
    assert main(argv) == 0
    assert len(rates) == 25 and rates[0] == pytest.approx(2e-3) and rates[12] == pytest.approx(1e-3)
    assert rates[-1] == pytest.approx(0.0, abs=1e-12) and rates == sorted(rates, reverse=True)
    manifest = json.loads((art / "lowbit.json").read_text())
    plan, rec = manifest["allocation"], manifest["provenance"]["rounding"]["tuning"]
    assert rec["schedule"] == "cosine"
    assert 8 * plan["bytes"] <= 7.6 * plan["weights"]
    assert rec["weights"] == sum(e["format"] in ("nf3", "nf4") for e in plan["tensors"].values()) > 0
    assert rec["validation_kl_after"] <= rec["validation_kl_before"]
    assert rec["norms"] == 2 * 2 + 2 * 2 + 1  # per layer: input, post-attention, q and k norms; the final one
    assert rec["plan_kl_measured_after"] >= 0 and plan["sensitivity"]["plan_kl_measured"] > 0
    assert rec["teacher"]["top_k"] == 8 and rec["teacher"]["bytes"] == rec["text"]["tokens"] * (8 * 8 + 4)
    assert 0 < rec["teacher"]["tail_mass_mean"] < 1
