"""Shared check: a tiny random HF model, saved by transformers, loaded by lowbit, must give
the same logits on the same tokens (float32), and in bf16 be as close to them as
transformers' own bf16 run is."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from lowbit.checkpoint.loader import load_model
from lowbit.engine.batch import ForwardBatch
from lowbit.engine.kv_cache import ContiguousKVCache

# float32 on both sides; differences come from op order only
MAX_ABS_TOL = 2e-4
TOP1_MIN = 1.0


def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids[None]).logits[0].float()


def lowbit_logits(path, ids: torch.Tensor, chunks: tuple[int, ...] = (),
                  dtype: str = "float32") -> torch.Tensor:
    """Run lowbit on `ids`; `chunks` splits the prompt into cached steps (chunked prefill)."""
    lm = load_model(path, dtype=dtype).model
    cache = ContiguousKVCache(lm.num_cache_layers, 1, len(ids))
    bounds = [0, *chunks, len(ids)]
    outs = []
    with torch.no_grad():
        for a, b in zip(bounds, bounds[1:]):
            batch = ForwardBatch.build([b - a], [a], [0], cache)
            outs.append(lm.compute_logits(lm(ids[a:b], batch)).float())
    return torch.cat(outs)


def save_tiny(hf_cls, config, tmp_path, seed: int = 0, randomize: tuple[str, ...] = (),
              prepare: Callable[[torch.nn.Module], None] | None = None):
    """Build, randomise and save an HF model. Every 1-D parameter is randomised (HF inits many
    to zero or one); so is any parameter or buffer whose name contains a `randomize` string.
    `prepare(model)` may then set weights a test needs (e.g. large enough to reach a clamp)."""
    torch.manual_seed(seed)
    model = hf_cls(config).eval().float()
    with torch.no_grad():  # random init of everything, including biases HF inits to zero
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() == 1 or any(r in name for r in randomize):
                p.copy_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if b.is_floating_point() and any(r in name for r in randomize):
                b.copy_(torch.randn_like(b) * 0.1)
        if prepare is not None:
            prepare(model)
    model.save_pretrained(tmp_path)
    return model


def assert_parity(hf_model, path, vocab: int, n_tokens: int = 23,
                  chunks: tuple[int, ...] = (9, 16)) -> tuple[float, float]:
    """Returns the worst (max |logit diff|, top-1 agreement) over the runs."""
    worst = (0.0, 1.0)
    ids = torch.randint(0, vocab, (n_tokens,), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(hf_model, ids)
    for ch in ((), chunks):
        got = lowbit_logits(path, ids, ch)
        err = (got - ref).abs().max().item()
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert err < MAX_ABS_TOL, f"max |logit diff| {err:.2e} (chunks {ch})"
        assert top1 >= TOP1_MIN, f"top-1 agreement {top1:.3f} (chunks {ch})"
        worst = (max(worst[0], err), min(worst[1], top1))
    return worst


def assert_bf16_parity(hf_model, path, vocab: int, n_tokens: int = 23) -> tuple[float, float]:
    """lowbit in bf16 is as close to the float32 logits as transformers in bf16 is: its max
    |logit error| at most 2x transformers' (+0.02), its top-1 agreement at most 0.1 lower.
    Returns (lowbit's error, transformers' error)."""
    ids = torch.randint(0, vocab, (n_tokens,), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(hf_model, ids)
    hf16 = hf_logits(copy.deepcopy(hf_model).to(torch.bfloat16), ids)
    got = lowbit_logits(path, ids, (9,), dtype="bfloat16")
    err, err_hf = (got - ref).abs().max().item(), (hf16 - ref).abs().max().item()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    top1_hf = (hf16.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert err <= 2 * err_hf + 0.02, f"bf16 max |logit diff| {err:.3f}, transformers' bf16 {err_hf:.3f}"
    assert top1 >= top1_hf - 0.1, f"bf16 top-1 {top1:.3f}, transformers' bf16 {top1_hf:.3f}"
    return err, err_hf


def assert_combine_deferred_exactly(monkeypatch, logits: Callable[[], torch.Tensor], combines_each: int) -> None:
    """The model's MoE layers on the grouped route, the combine deferred into the next norm
    (lowbit.kernels.moe_slots.SlotSum) or launched (LOWBIT_SLOT_FUSION=0): no combine launch
    when deferred, `combines_each` a run when not, and the same logits bit for bit, with the
    norm on its Triton route and on the torch route."""
    from lowbit.kernels import moe as moe_kernels

    combines = []
    real = moe_kernels.combine_slots
    monkeypatch.setattr(moe_kernels, "combine_slots", lambda *a, **k: combines.append(1) or real(*a, **k))
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "triton_moe_grouped")
    for norm in ("triton_rmsnorm", "torch"):
        monkeypatch.setenv("LOWBIT_ROUTE_NORM", norm)
        got = {}
        for fusion in ("0", "1"):
            monkeypatch.setenv("LOWBIT_SLOT_FUSION", fusion)
            combines.clear()
            got[fusion] = logits()
            assert len(combines) == (0 if fusion == "1" else combines_each), (norm, fusion, len(combines))
        assert torch.equal(got["0"], got["1"]), norm
