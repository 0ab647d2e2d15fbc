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
        _windows(model, ids, device, context, stop_after)
    return sums


def _raise_stop() -> None:
    raise _Stop


def _windows(model: nn.Module, ids: list[int], device: str, context: int, stop_after) -> None:
    """Forward `model` over ids in windows, each stopping after `stop_after` when given."""
    width = min(WINDOW, context)
    stop = None if stop_after is None else stop_after.register_forward_hook(lambda *_: _raise_stop())
    try:
        with torch.inference_mode():
            for s in range(0, len(ids), width):
                x = torch.tensor(ids[s:s + width], device=device)
                try:
                    model(x, ForwardBatch.build([len(x)], [0], None, None, torch.device(device)))
                except _Stop:
                    pass
    finally:
        if stop is not None:
            stop.remove()


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


def round_sequentially(model: nn.Module, rounding: dict[str, object], ids: list[int], device: str,
                       context: int, round_fn) -> dict[str, int]:
    """GPTQ layer by layer (`--sequential`): each group of sequential_groups takes its
    Hessians from a pass of the model whose earlier groups are already rounded, so that a
    weight is rounded for the inputs the quantized model will give it, and the pass stops
    after the group's decoder layer. rounding: weight name -> format; round_fn(fmt, w, h)
    returns the QuantizedTensor (h None where no token reached the weight). Returns counts."""
    targets = swappable(model)
    groups = sequential_groups(model, list(rounding))
    for i, names in enumerate(groups):
        m = _LAYER.search(names[-1])  # stop after the group's decoder layer (its modules'
        # forward order within the layer need not be their names' order)
        last = model.get_submodule(names[-1][:m.end() - 1]) if m and i + 1 < len(groups) else None
        sums = collect_hessians(model, QuantPlan({n: rounding[n] for n in names}), ids, device, context, last)
        for n in names:
            mod, attr = targets[n]
            w = getattr(mod, attr).data
            set_quantized(mod, attr, round_fn(rounding[n], w, sums.mean(n).to(w.device) if sums.seen(n) else None))
    return {"groups": len(groups)}


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
