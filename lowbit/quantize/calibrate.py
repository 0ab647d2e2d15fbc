"""Calibration for `lowbit quantize --calib FILE`: the input Hessian of every weight a format
replaces, from one pass of the dense model over the file's tokens, then each weight
rounded by lowbit.quantize.gptq.

Shape legend: T tokens, K a weight's input dim, E experts, A active experts per token.
H = X^T X / n over the inputs X [n, K] a weight sees (float32 accumulation): a Linear's
inputs over all T tokens; an expert's w13 over the tokens routed to it, its w2 over those
tokens' activations act(x w13^T). An expert routed fewer than MIN_TOKENS tokens takes its
layer's H over all routed tokens instead. By default all Hessians come from the dense
model (the rounding of one layer does not change the inputs another layer is calibrated
on); with `--sequential` (round_sequentially) each decoder layer's come from the model whose
earlier layers are already rounded.
For the byte-budget allocator, each expert also sums g^2 over its routed tokens (g its
routing weight, which scales its output): g2 / tokens puts an expert's mean output error
on the per-token scale of a Linear's.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from lowbit.checkpoint.quant_plan import QuantPlan, swappable
from lowbit.engine.batch import ForwardBatch
from lowbit.errors import LowbitError
from lowbit.formats import QuantizedTensor
from lowbit.layers.linear import Linear, set_quantized
from lowbit.layers.moe import Experts
from lowbit.quantize.gptq import DAMP
from lowbit.quantize.gptq_vq import calibrated_rounding, has_calibrated_rounding

MIN_TOKENS = 32  # an expert routed fewer tokens than this takes its layer's Hessian
WINDOW = 1024  # tokens per calibration forward pass (at most the model's context)


@dataclass
class Calibration:
    """The calibration text and what lowbit.json records about it."""

    path: Path
    text: str
    sha256: str

    @classmethod
    def read(cls, path: str | Path) -> Calibration:
        p = Path(path)
        if not p.is_file():
            raise LowbitError(f"--calib {path}: " + ("no such file" if not p.exists() else "not a file")
                              + "; give a UTF-8 text file to calibrate on.")
        try:
            data = p.read_bytes()
            text = data.decode("utf-8")
        except OSError as e:
            raise LowbitError(f"--calib {path} cannot be read: {e.strerror}.") from None
        except UnicodeDecodeError as e:
            raise LowbitError(f"--calib {path} is not UTF-8 text (byte {e.start}); give a text file.") from None
        if not text.strip():
            raise LowbitError(f"--calib {path} is empty; give some text to calibrate on.")
        return cls(p, text, hashlib.sha256(data).hexdigest())


@dataclass
class HessianSums:
    """Running X^T X and token counts per planned weight: [K, K] and 0-dim, or [E, K, K] and [E]."""

    h: dict[str, Tensor] = field(default_factory=dict)
    n: dict[str, Tensor] = field(default_factory=dict)
    g2: dict[str, Tensor] = field(default_factory=dict)  # expert stacks: [E] sum of squared routing weights
    tokens: int = 0  # tokens of the calibration pass

    def add(self, pname: str, x: Tensor, expert: int | None = None) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [n, K]
        xtx = x.T @ x
        if expert is None:
            self.h[pname] = self.h.get(pname, 0) + xtx
            self.n[pname] = self.n.get(pname, 0) + x.shape[0]
        else:
            self.h[pname][expert] += xtx
            self.n[pname][expert] += x.shape[0]

    def output_weight(self, pname: str) -> Tensor | None:
        """[E] per-token share of each expert's output (mean g^2 over all tokens); None for a Linear."""
        g2 = self.g2.get(pname)
        return None if g2 is None else g2 / max(self.tokens, 1)

    def seen(self, pname: str) -> bool:
        """Whether any calibration token reached this weight."""
        return pname in self.n and int(torch.as_tensor(self.n[pname]).sum()) > 0

    def mean(self, pname: str) -> Tensor:
        """H / n; rarely routed experts take the layer's pooled H / n."""
        h, n = self.h[pname], self.n[pname]
        if h.dim() == 2:
            return h / max(int(n), 1)
        pooled = h.sum(0) / max(int(n.sum()), 1)  # [K, K]
        per = h / n.clamp(min=1).to(h)[:, None, None]
        return torch.where((n < MIN_TOKENS)[:, None, None], pooled, per)


class _Stop(Exception):
    """Raised by a forward hook once the weights being calibrated have seen their inputs."""


def collect_hessians(model: nn.Module, plan: QuantPlan, ids: list[int], device: str,
                     context: int = WINDOW, stop_after: nn.Module | None = None) -> HessianSums:
    """Run the model over ids in windows of at most `context` tokens; hooks sum X^T X for
    each planned weight. stop_after: a module after whose forward the rest of the model
    need not run (its outputs feed no planned weight)."""
    sums = HessianSums()
    sums.tokens = len(ids)
    with hessian_hooks(model, plan, sums):
        _windows(model, ids, device, context, stop_after, lambda i: None)
    return sums


def _raise_stop() -> None:
    raise _Stop


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def sequential_groups(model: nn.Module, names: list[str]) -> list[list[str]]:
    """The planned weights in the order sequential calibration rounds them: per decoder layer,
    its attention projections, then the rest (MLP, experts, shared experts); weights outside
    the decoder layers (lm_head) last. Within a group the Hessians come from one pass."""
    order = {n: i for i, n in enumerate(swappable(model))}
    groups: dict[tuple[int, int], list[str]] = {}
    for n in sorted(names, key=order.__getitem__):
        m = _LAYER.search(n)
        key = (int(m.group(1)), 0 if "attn" in n else 1) if m else (1 << 30, 0)
        groups.setdefault(key, []).append(n)
    return [groups[k] for k in sorted(groups)]


@contextmanager
def _input_hooks(model: nn.Module, names: list[str], record) -> Iterator[None]:
    """While open, record(name, args) gets the forward inputs of each weight's module (an
    expert stack's: its layer's x, ids, w) at every forward."""
    hooks, done = [], set()
    for pname, (mod, _) in swappable(model).items():
        if pname in names and id(mod) not in done:
            done.add(id(mod))
            hooks.append(mod.register_forward_pre_hook(lambda m, args, pname=pname: record(pname, args)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _windows(model: nn.Module, ids: list[int], device: str, context: int, stop_after, step) -> None:
    """Forward `model` over ids in windows (step(i) before window i), stopping after `stop_after`."""
    width = min(WINDOW, context)
    stop = None if stop_after is None else stop_after.register_forward_hook(lambda *_: _raise_stop())
    try:
        with torch.inference_mode():
            for i, s in enumerate(range(0, len(ids), width)):
                step(i)
                x = torch.tensor(ids[s:s + width], device=device)
                try:
                    model(x, ForwardBatch.build([len(x)], [0], None, None, torch.device(device)))
                except _Stop:
                    pass
    finally:
        if stop is not None:
            stop.remove()


def cross_terms(model: nn.Module, dense: nn.Module, names: list[str], ids: list[int], device: str,
                context: int, stop_after: tuple[nn.Module, nn.Module] | None) -> tuple[HessianSums, dict]:
    """The rounded model's Hessians H~ = X~^T X~ of `names` (HessianSums) and the cross terms
    C = X~^T X with the dense model's inputs X for the same tokens, summed over the windows
    (an expert's: over the tokens the rounded model routes to it, X~ and X at those tokens;
    w2's inputs act(x w13^T) with the layer's still unrounded w13 on both sides)."""
    targets = swappable(model)
    kept: dict[tuple[str, int], tuple] = {}
    window = [0]
    with _input_hooks(dense, names, lambda n, a: kept.__setitem__((n, window[0]), a)):
        _windows(dense, ids, device, context, stop_after and stop_after[1], lambda i: window.__setitem__(0, i))
    sums, cross = HessianSums(), {}
    sums.tokens = len(ids)

    def add(pname: str, args) -> None:
        mod, attr = targets[pname]
        xd = kept[(pname, window[0])][0]
        if isinstance(mod, Experts):
            x, ids_, w = args[:3]
            _expert_cross(mod, pname, sums, cross, x, xd, ids_, w)
            return
        xq = args[0].reshape(-1, args[0].shape[-1]).float()
        sums.add(pname, xq)
        cross[pname] = cross.get(pname, 0) + xq.T @ xd.reshape(-1, xd.shape[-1]).float()

    with _input_hooks(model, names, add):
        _windows(model, ids, device, context, stop_after and stop_after[0], lambda i: window.__setitem__(0, i))
    return sums, cross


def _expert_cross(mod: Experts, pname: str, sums: HessianSums, cross: dict, x: Tensor, xd: Tensor,
                  ids: Tensor, w: Tensor) -> None:
    e_all, k13, k2 = mod.w13.shape[0], mod.w13.shape[2], mod.w2.shape[2]
    w2name = pname[:-3] + "w2"
    for name, k in ((pname, k13), (w2name, k2)):
        if name not in sums.h:
            sums.h[name] = torch.zeros(e_all, k, k, device=x.device)
            sums.n[name] = torch.zeros(e_all, dtype=torch.long, device=x.device)
            cross[name] = torch.zeros(e_all, k, k, device=x.device)
    for e in torch.unique(ids).tolist():  # host sync: calibration only
        tok = (ids == e).any(-1).nonzero()[:, 0]
        xq, xe = x[tok].float(), xd[tok].float()
        bias = None if mod.b13 is None else mod.b13[e].float()
        aq = mod.act(nn.functional.linear(xq, mod.w13[e].float(), bias))
        ad = mod.act(nn.functional.linear(xe, mod.w13[e].float(), bias))
        sums.add(pname, xq, e)
        sums.add(w2name, aq, e)
        cross[pname][e] += xq.T @ xe
        cross[w2name][e] += aq.T @ ad


def corrected_target(w: Tensor, h: Tensor, c: Tensor, n: Tensor, alpha: float, damp: float) -> Tensor:
    """W moved a fraction alpha toward W C^T H~^{-1}, the least-squares weight on the rounded
    model's inputs X~ for the dense outputs X W^T (H~ = X~^T X~, C = X~^T X, both summed over
    n tokens, damped as GPTQ damps H~). w [N, K] or [E, N, K]; an expert with fewer than
    MIN_TOKENS tokens keeps W."""
    hd = h.double().clone()
    keep = torch.as_tensor(n) < MIN_TOKENS  # [E] for a stack (rare experts keep W), 0-dim else
    if w.dim() == 3:  # a rare expert's H~ may be all zeros: solve with the identity instead
        hd[keep] = torch.eye(h.shape[-1], dtype=hd.dtype, device=hd.device)
    diag = hd.diagonal(dim1=-2, dim2=-1)
    diag += damp * diag.mean(-1, keepdim=True)
    best = torch.linalg.solve(hd, c.double() @ w.double().transpose(-1, -2)).transpose(-1, -2)  # W C^T H~^-1
    out = w.double() + alpha * (best - w.double())
    if w.dim() == 3:
        out = torch.where(keep[:, None, None], w.double(), out)
    return out.to(w.dtype)


def round_sequentially(model: nn.Module, rounding: dict[str, object], ids: list[int], device: str,
                       context: int, damp: float, round_fn, correct: float = 0.0,
                       dense: nn.Module | None = None) -> dict[str, int]:
    """GPTQ layer by layer (`--sequential`): each group of sequential_groups takes its
    Hessians from a pass of the model whose earlier groups are already rounded, so that a
    weight is rounded for the inputs the quantized model will give it, and the pass stops
    after the group's decoder layer. rounding: weight name -> format; round_fn(fmt, w, h)
    returns the QuantizedTensor (h None where no token reached the weight). Returns counts."""
    targets = swappable(model)
    counts = {"groups": 0, "passes_tokens": 0, "corrected": 0}
    groups = sequential_groups(model, list(rounding))
    if correct:
        dense = dense if dense is not None else copy.deepcopy(model)
    for i, names in enumerate(groups):
        plan = QuantPlan({n: rounding[n] for n in names})
        m = _LAYER.search(names[-1])  # stop after the group's decoder layer (its modules'
        # forward order within the layer need not be their names' order)
        layer = names[-1][:m.end() - 1] if m and i + 1 < len(groups) else None
        last = None if layer is None else model.get_submodule(layer)
        if correct:
            stops = None if layer is None else (last, dense.get_submodule(layer))
            sums, cross = cross_terms(model, dense, [n for n in names if not n.endswith(".w2")], ids, device,
                                      context, stops)
        else:
            sums, cross = collect_hessians(model, plan, ids, device, context, stop_after=last), {}
        for n in names:
            mod, attr = targets[n]
            w = getattr(mod, attr).data
            h = sums.mean(n).to(w.device) if sums.seen(n) else None
            if h is not None and n in cross:
                w = corrected_target(w, sums.h[n], cross[n], sums.n[n], correct, damp)
                counts["corrected"] += 1
            set_quantized(mod, attr, round_fn(rounding[n], w, h))
        counts["groups"] += 1
        counts["passes_tokens"] += sums.tokens
    return counts


@contextmanager
def hessian_hooks(model: nn.Module, plan: QuantPlan, sums: HessianSums) -> Iterator[None]:
    """While open, every forward of `model` (or of one of its layers) adds the inputs of
    each planned weight under it to `sums`."""
    hooks = []
    for pname, (mod, attr) in swappable(model).items():
        if pname not in plan.quantized:
            continue
        if isinstance(mod, (Linear, nn.Linear)):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, args, pname=pname: sums.add(pname, args[0])))
        elif isinstance(mod, Experts) and attr == "w13":
            e, k13, k2 = mod.w13.shape[0], mod.w13.shape[2], mod.w2.shape[2]
            for name, k in ((f"{pname}", k13), (pname[:-3] + "w2", k2)):
                sums.h[name] = torch.zeros(e, k, k, device=mod.w13.device)
                sums.n[name] = torch.zeros(e, dtype=torch.long, device=mod.w13.device)
                sums.g2[name] = torch.zeros(e, dtype=torch.float64, device=mod.w13.device)
            hooks.append(mod.register_forward_pre_hook(
                lambda m, args, pname=pname: _expert_inputs(m, pname, sums, *args)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _expert_inputs(mod: Experts, pname: str, sums: HessianSums, x: Tensor, ids: Tensor, w: Tensor,
                   *_shared) -> None:
    """x [T, D], ids [T, A]: each expert's w13 and w2 inputs over the tokens routed to it
    (a shared-experts argument after them is not read here)."""
    for e in torch.unique(ids).tolist():  # host sync: calibration only
        hit = ids == e  # [T, A]
        tok = hit.any(-1).nonzero()[:, 0]
        g2 = float((w.float() * hit).sum(-1)[tok].pow(2).sum())
        sums.g2[pname][e] += g2
        sums.g2[pname[:-3] + "w2"][e] += g2
        xe = x[tok].float()  # [n, D]
        bias = None if mod.b13 is None else mod.b13[e].float()
        act = mod.act(nn.functional.linear(xe, mod.w13[e].float(), bias))  # [n, I]
        sums.add(pname, xe, e)
        sums.add(pname[:-3] + "w2", act, e)


def calibrated_quantize(model: nn.Module, plan: QuantPlan, sums: HessianSums,
                        damp: float = DAMP) -> dict[str, int]:
    """Replace every planned weight by its GPTQ rounding; count what was done."""
    counts = {"gptq": 0, "nearest": 0, "expert_matrices_pooled": 0}
    for pname, (mod, attr) in swappable(model).items():
        fmt = plan.quantized.get(pname)
        if fmt is None:
            continue
        assert has_calibrated_rounding(fmt), f"{pname}: {fmt} has no calibrated rounding"
        w = getattr(mod, attr).data
        if sums.seen(pname):
            qt = calibrated_rounding(fmt, w, sums.mean(pname).to(w.device), damp)
            counts["gptq"] += 1
            if sums.h[pname].dim() == 3:
                counts["expert_matrices_pooled"] += int((sums.n[pname] < MIN_TOKENS).sum())
        else:  # a planned weight no calibration forward reached (e.g. lm_head): nearest rounding
            qt = QuantizedTensor(fmt, tuple(w.shape), fmt.encode(w))
            counts["nearest"] += 1
        set_quantized(mod, attr, qt)
    return counts
