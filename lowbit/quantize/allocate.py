"""`lowbit quantize --bpw B`: one format per quantized tensor under a byte budget.

Shape legend: E experts, N rows, K input columns; F candidate formats, C budget cells.

Each tensor the plan quantizes (every Linear weight and expert stack w13 / w2) is rounded in
every candidate format; its cost is the stored bytes of that payload (codes, scales,
tables: QuantizedTensor.nbytes, what the artifact writes; the `dense` candidate costs the
tensor in the artifact's dtype) and its error one of two sensitivities:
- kl: the measured KL increase of the model's next-token distribution on calibration
  tokens with that tensor alone rounded (lowbit.quantize.sensitivity);
- proxy: with Hessians H = X^T X / n from calibration text, trace((W - Q) H (W - Q)^T)
  (for a stack, summed over experts weighted by each one's mean squared routing weight per
  calibration token, its share of the layer's output), else ||W - Q||^2.
The choice minimises the summed error subject to sum(bytes) * 8 <= B * (weights of those
tensors), as a multiple-choice knapsack solved exactly over bytes rounded up to cells of
`unit` bytes (so the budget holds exactly by the true byte count; the cell size depends on
the candidates only, so more budget never gives a larger error).

One constraint keeps every plan runnable on the GPU routes: the two expert stacks of a layer
(`P.w13`, `P.w2`) are both vector-codebook formats or neither, because the fused MoE routes
read scalar / fp8 / dense stacks in any mix and the vq MoE kernels read vq stacks only (a
mixed layer would run the torch route: host reads, no decode graph). The knapsack takes such
a pair as one item whose candidates are the allowed (w13, w2) combinations.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lowbit.checkpoint.quant_plan import plan_quantization, swappable
from lowbit.errors import LowbitError
from lowbit.formats import Format, QuantizedTensor, get_format
from lowbit.formats.vq import VqFormat
from lowbit.quantize.calibrate import HessianSums
from lowbit.quantize.gptq_vq import calibrated_rounding, has_calibrated_rounding
from lowbit.quantize.sensitivity import KLProbe

DENSE = "dense"  # the candidate that keeps a tensor unquantized, in the artifact's dtype
CELLS = 65536  # budget cells over the costliest assignment: rounding loss <= tensors / CELLS of it


@dataclass
class Candidate:
    """One tensor rounded in one format: what it stores and what it loses."""

    format: str
    nbytes: int
    error: float


@dataclass
class TensorChoices:
    name: str
    weights: int
    candidates: list[Candidate] = field(default_factory=list)


def proxy_error(w: Tensor, qt: QuantizedTensor, h: Tensor | None, share: Tensor | None = None) -> float:
    """w [N, K] or [E, N, K]; h None, [K, K] or [E, K, K]: trace(D H D^T) per matrix, D = w - q,
    summed with weights share [E] (an expert's per-token output share; default 1)."""
    d = (w.float() - qt.dequantize(torch.float32).to(w.device)).reshape(-1, *w.shape[-2:])  # [E, N, K]
    if h is None:
        per = d.pow(2).sum((1, 2))  # [E]
    else:
        h3 = h.float().reshape(-1, w.shape[-1], w.shape[-1]).to(d.device)  # [E, K, K]
        per = ((d @ h3) * d).sum((1, 2))
    return float(per.double().sum() if share is None else (per.double() * share.to(per.device)).sum())


def kernel_family(fmt: str) -> str:
    """"vq" for a vector-codebook format, else "lut" (scalar, fp8, dense: what the fused MoE
    routes read in any mix)."""
    try:
        return "vq" if isinstance(get_format(fmt), VqFormat) else "lut"
    except (KeyError, LowbitError):  # `dense` and names outside the registry
        return "lut"


EXPERT_PAIRS = ("family", "free")  # --expert-pairs: one kernel family a layer (default), or each stack alone


def _paired(tensors: list[TensorChoices]) -> tuple[list[TensorChoices], dict[str, tuple[TensorChoices, TensorChoices]]]:
    """The knapsack's items: each layer's w13 and w2 merged into one item of the allowed
    (w13, w2) candidate pairs (named "w13 format|w2 format"); other tensors as they are."""
    by_name = {t.name: t for t in tensors}
    items, pairs = [], {}
    for t in tensors:
        if t.name.endswith(".w2") and t.name[:-2] + "w13" in by_name:
            continue  # taken with its w13
        mate = by_name.get(t.name[:-3] + "w2") if t.name.endswith(".w13") else None
        if mate is None:
            items.append(t)
            continue
        key = f"{t.name}+w2"
        cands = [Candidate(f"{a.format}|{b.format}", a.nbytes + b.nbytes, a.error + b.error)
                 for a in t.candidates for b in mate.candidates
                 if kernel_family(a.format) == kernel_family(b.format)]
        if not cands:
            raise LowbitError(f"{t.name} and {mate.name}: no candidate pair of one kernel family (both vector "
                              "codebook formats or neither); add a format both take to --formats.")
        items.append(TensorChoices(key, t.weights + mate.weights, cands))
        pairs[key] = (t, mate)
    return items, pairs


def allocate(tensors: list[TensorChoices], bpw: float, expert_pairs: str = "family") -> dict[str, Candidate]:
    """The choice of least summed error with sum(nbytes) * 8 <= bpw * sum(weights), each
    layer's expert stacks in one kernel family (module docstring); expert_pairs "free": every
    tensor alone (a plan whose mixed layers run the torch MoE route on a GPU)."""
    if expert_pairs not in EXPERT_PAIRS:
        raise LowbitError(f"--expert-pairs {expert_pairs}: give one of {', '.join(EXPERT_PAIRS)}.")
    items, pairs = _paired(tensors) if expert_pairs == "family" else (tensors, {})
    chosen = _knapsack(items, bpw)
    out: dict[str, Candidate] = {}
    for name, cand in chosen.items():
        if name not in pairs:
            out[name] = cand
            continue
        for member, fmt in zip(pairs[name], cand.format.split("|")):
            out[member.name] = next(c for c in member.candidates if c.format == fmt)
    return dict(sorted(out.items()))


def _knapsack(tensors: list[TensorChoices], bpw: float) -> dict[str, Candidate]:
    """The multiple-choice knapsack over `tensors` (items), exact over `unit`-byte cells."""
    if not tensors:
        raise LowbitError("no tensor to quantize: the model has no Linear or expert weight a format takes.")
    weights = sum(t.weights for t in tensors)
    budget = math.floor(bpw * weights / 8)
    cheapest = sum(min(c.nbytes for c in t.candidates) for t in tensors)
    if cheapest > budget:
        names = sorted({f for t in tensors for f in min(t.candidates, key=lambda c: c.nbytes).format.split("|")})
        raise LowbitError(f"--bpw {bpw}: the cheapest candidates ({', '.join(names)}) already take "
                          f"{8 * cheapest / weights:.3f} bits per weight; raise --bpw or add a cheaper "
                          "format to --formats.")
    costliest = sum(max(c.nbytes for c in t.candidates) for t in tensors)
    unit = max(1, math.ceil(costliest / CELLS))
    cells = budget // unit
    best = torch.zeros(cells + 1, dtype=torch.float64)  # least error within c cells
    picks = []
    for t in tensors:
        new = torch.full_like(best, math.inf)
        pick = torch.full((cells + 1,), -1, dtype=torch.int16)
        for i, c in enumerate(t.candidates):
            k = math.ceil(c.nbytes / unit)
            if k > cells:
                continue
            trial = torch.full_like(best, math.inf)
            trial[k:] = best[: cells + 1 - k] + c.error
            better = trial < new
            new = torch.where(better, trial, new)
            pick[better] = i
        best, picks = new, picks + [pick]
    c = int(torch.argmin(best))  # ties: the fewest cells
    if not math.isfinite(float(best[c])):  # cheapest fits in bytes but not once rounded to cells
        raise LowbitError(f"--bpw {bpw} leaves no room above the cheapest candidates; raise it a little.")
    out: dict[str, Candidate] = {}
    for t, pick in zip(reversed(tensors), reversed(picks)):
        cand = t.candidates[int(pick[c])]
        out[t.name] = cand
        c -= math.ceil(cand.nbytes / unit)
    return dict(sorted(out.items()))


def plan_table(tensors: list[TensorChoices], chosen: dict[str, Candidate], bpw: float) -> str:
    """format -> tensors, weights, bytes, bits per weight; then the total against the budget."""
    sizes = {t.name: t.weights for t in tensors}
    rows: dict[str, list[int]] = {}
    for name, c in chosen.items():
        r = rows.setdefault(c.format, [0, 0, 0])
        r[0], r[1], r[2] = r[0] + 1, r[1] + sizes[name], r[2] + c.nbytes
    lines = [f"{'format':<10} {'tensors':>7} {'weights':>12} {'bytes':>12} {'bpw':>7}"]
    for f, (n, w, b) in sorted(rows.items(), key=lambda kv: 8 * kv[1][2] / kv[1][1]):
        lines.append(f"{f:<10} {n:>7} {w:>12,} {b:>12,} {8 * b / w:>7.3f}")
    w, b = sum(sizes.values()), sum(c.nbytes for c in chosen.values())
    lines.append(f"{'total':<10} {len(chosen):>7} {w:>12,} {b:>12,} {8 * b / w:>7.3f}  (budget {bpw})")
    return "\n".join(lines)


def plan_record(tensors: list[TensorChoices], chosen: dict[str, Candidate], bpw: float,
                candidates: list[str], sensitivity: dict, expert_pairs: str = "family") -> dict:
    """What lowbit.json keeps under "allocation"."""
    sizes = {t.name: t.weights for t in tensors}
    w, b = sum(sizes.values()), sum(c.nbytes for c in chosen.values())
    return {"bpw_budget": bpw, "bits_per_weight": round(8 * b / w, 6), "weights": w, "bytes": b,
            "formats": candidates, "sensitivity": sensitivity,
            "expert_pairs": ("a layer's w13 and w2 in one kernel family (both vq or neither)"
                             if expert_pairs == "family" else "free: each expert stack chosen alone"),
            "tensors": {n: {"format": c.format, "bits": round(8 * c.nbytes / sizes[n], 6),
                            "bytes": c.nbytes, "error": c.error} for n, c in chosen.items()},
            "candidates": {t.name: {c.format: [c.nbytes, c.error] for c in t.candidates} for t in tensors}}


def round_weight(fmt: Format, w: Tensor, h: Tensor | None, damp: float) -> QuantizedTensor:
    """GPTQ rounding on h for the scalar and vector formats, nearest rounding otherwise."""
    if h is not None and has_calibrated_rounding(fmt):
        return calibrated_rounding(fmt, w, h, damp)
    return fmt.quantize(w)


def tensor_choices(model: nn.Module, formats: list[Format], sums: HessianSums | None, damp: float,
                   quantize_lm_head: bool = False, probe: KLProbe | None = None,
                   dense_bits: int | None = None,
                   table: dict | None = None) -> tuple[list[TensorChoices], dict[str, str]]:
    """Every tensor some candidate format takes, rounded in each one that takes it and scored
    by `probe` (measured KL) or else the proxy, or looked up in `table` (an earlier plan's
    `candidates`: name -> format -> [bytes, error]); plus a `dense` candidate of
    `dense_bits` per weight; and the dense reasons of the tensors no format takes."""
    plans = [plan_quantization(model, f.name, quantize_lm_head) for f in formats]
    out: list[TensorChoices] = []
    todo = [(p, ma) for p, ma in swappable(model).items() if any(p in plan.quantized for plan in plans)]
    for i, (pname, (mod, attr)) in enumerate(todo):
        t0 = time.perf_counter()
        w = getattr(mod, attr).data
        h = sums.mean(pname).to(w.device) if sums is not None and sums.seen(pname) else None
        share = sums.output_weight(pname) if h is not None else None
        t = TensorChoices(pname, w.numel())
        for f, plan in zip(formats, plans):
            if pname in plan.quantized:
                t.candidates.append(_looked_up(table, pname, f.name) if table is not None else
                                    _scored(f, w, h, share, damp, probe, mod, attr))
        if dense_bits is not None:
            t.candidates.append(Candidate(DENSE, w.numel() * dense_bits // 8, 0.0))
        out.append(t)
        if probe is not None and table is None:
            print(f"sensitivity {i + 1}/{len(todo)} {pname}: {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                  flush=True)
    taken = {t.name for t in out}
    dense = {n: r for p in plans for n, r in p.dense.items() if n not in taken}
    return out, dense


def _scored(f: Format, w: Tensor, h: Tensor | None, share: Tensor | None, damp: float,
            probe: KLProbe | None, mod: nn.Module, attr: str) -> Candidate:
    qt = round_weight(f, w, h, damp)
    err = probe.delta_kl(mod, attr, qt) if probe is not None else proxy_error(w, qt, h, share)
    return Candidate(f.name, qt.nbytes, err)


def _looked_up(table: dict, pname: str, fmt: str) -> Candidate:
    try:
        nbytes, err = table[pname][fmt]
    except KeyError:
        raise LowbitError(f"the earlier scores have none for {pname} in {fmt}: drop {fmt} from --formats, "
                          "or score again without --sensitivity-from.") from None
    return Candidate(fmt, int(nbytes), float(err))
