"""Block scales tuned against the teacher's next-token distributions
(`lowbit quantize --calib FILE --tune-scales STEPS`).

Shape legend: L leading dims (stacked experts), N rows, K input columns, NB blocks of 64
along K, Kp = 64 * NB, S windows of W tokens, V vocabulary.

After rounding, a weight in nf4 / nf3 / lut4 / lut3 / vq2 / vq3 / vq4 decodes blockwise as
w = u * s: u [L, N, Kp] the weight decoded with every bfloat16 block scale set to 1 (codes,
tables and codebooks fixed), s [L, N, NB] its scales. Tuning keeps u and learns one factor
exp(t) per block (t = 0 at the start) by Adam on the mean KL(p || q) of the next-token
distributions over windows of the tuning text (at most TOKENS tokens, windows spread evenly
over a longer text): p from the unquantized model (one pass before rounding), q from the
model with the tuned weights. Every tenth window (the last one when there are fewer than
ten) is a validation split, never trained on: its KL, every EVAL_EVERY steps with the
scales rounded to bfloat16 as stored, picks the factors that are kept (those of the best
check, or none when no check beats t = 0). The stored scale is bf16(s * exp(t)): the
payload keeps its format, shapes and bytes, so bits per weight, decoding and every kernel
route are unchanged. Other formats keep their rounding. With `norms`, each RMSNorm weight g
(dense, outside the byte budget) is tuned alike as g * exp(t) per entry.

With `codes` (a learning rate), the codes move too: each tunable weight (vq: those whose K is
a whole number of D-groups) keeps a latent unit-scale weight v [L, N, NB, 64], v = u at the
start (padding columns 0 there, never moved: their gradient is 0), and
decodes as w = s * exp(t) * Q(v), Q the nearest entry of the weight's own grid (its row's
table for nf / lut, the codebook's nearest vector for vq, groups of D along K). The gradient
reaches v straight through Q (as if Q(v) were v); Adam moves v at the `codes` rate, and a
code changes when v crosses to another entry's cell. Every stored code is an index into the
same table or codebook, so the payload keeps its format and bytes; the validation check
keeps the codes of its best step with the factors.

Q for vq searches from each group's entry of the last step: x a group of v, c its entry,
d = |x - c|, alone(c) the distance from c to the nearest other entry, reach(c) to the nearest
entry not among c's NEIGHBOURS nearest. If 2d < alone(c), c is the nearest (any other e:
|x - e| >= |e - c| - d >= alone(c) - d > d). Else the nearest of c's neighbours, at
distance b, is the nearest of all if d + b <= reach(c) (any e not listed: |x - e| >= reach(c)
- d >= b). Else the group searches all C entries. Latents move little a step, so almost
every group stops at the first test. The nf / lut tables (<= 16 values) are searched whole.

The teacher is kept as its TOPK most likely tokens per position (ids int32 and
log-probabilities float32 [S * W, TOPK]) and the mass of the rest (float32 [S * W]):
8 * TOPK + 4 bytes a token instead of 4 * V (2,052 against 607,744 at V = 151,936). The
loss is then the KL between p and q coarsened to those TOPK tokens plus one tail bucket,
sum_top p_i log(p_i / q_i) + p_tail log(p_tail / q_tail), q_tail = 1 - sum_top q_i: never
more than the full KL (coarsening cannot raise a KL), equal to it when the tail holds at
most one token. Its gradient in the student's logits z is the full KL's, q_j - p_j, on the
top tokens, and q_j (1 - p_tail / q_tail) on the others (the tail's p spread as q spreads
it). With topk 0 (or >= V) the full [S * W, V] log-probabilities are kept.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from lowbit.engine.batch import ForwardBatch
from lowbit.errors import LowbitError
from lowbit.formats import QuantizedTensor, get_format
from lowbit.formats.codes import nearest_code, pack_codes
from lowbit.formats.lut import LutFormat
from lowbit.formats.nf import NormalFloatFormat
from lowbit.formats.vq import VqFormat, pack_indices
from lowbit.layers.norm import RMSNorm
from lowbit.quantize.calibrate import Calibration
from lowbit.quantize.gptq import row_tables

BLOCK = 64  # weights per bfloat16 scale in every tunable format
WINDOW = 512  # tokens per window of the tuning text
TOKENS = 65536  # most tokens tuned on
TOPK = 256  # teacher tokens kept per position (0: all V; docs/BENCHMARKS.md "Tuned block scales")
BATCH = 4  # windows per step
LR = 2e-3  # Adam step on t (a factor exp(t) moves by about LR per step)
LR_CODES = 1e-3  # Adam step on the latent unit-scale weights with `codes` (--tune-codes)
EVAL_EVERY = 25  # steps between validation checks
SCHEDULES = ("constant", "cosine")  # the rates over the steps: fixed, or a half cosine from the rate to 0
VAL_EVERY = 10  # every 10th window is a validation window


TUNABLE = ("nf4", "nf3", "lut4", "lut3", "vq2", "vq3", "vq4")


def tunable(qt: object) -> bool:
    """Whether qt decodes as (unit-scale decode) * bf16 block scale, blocks of BLOCK along K."""
    return (isinstance(qt, QuantizedTensor) and isinstance(qt.format, (NormalFloatFormat, LutFormat, VqFormat))
            and qt.format.block_size == BLOCK and qt.payload["scales"].dtype == torch.bfloat16)


@dataclass
class TuneText:
    """The tuning text as windows of token ids, and what lowbit.json records about it."""

    path: Path
    sha256: str
    windows: list[list[int]]

    steps: int

    @classmethod
    def build(cls, calibration: Calibration, ids: list[int], steps: int, window: int = WINDOW,
              tokens: int = TOKENS) -> TuneText:
        """Windows of `window` tokens; at most tokens // window of them, spread evenly over the text."""
        wins = [ids[s:s + window] for s in range(0, len(ids) - window + 1, window)]
        keep = max(2, tokens // window)
        if len(wins) > keep:
            wins = [wins[i * len(wins) // keep] for i in range(keep)]
        if len(wins) < 2:
            raise LowbitError(f"--tune-scales trains on windows of {window} tokens and checks on some it does "
                              f"not train on; {calibration.path} gives {len(ids)} tokens, give {2 * window} or more.")
        return cls(calibration.path, calibration.sha256, wins, steps)

    def validation(self, i: int) -> bool:
        """Whether window i is in the validation split (every VAL_EVERY-th, the last one if none)."""
        n = len(self.windows)
        return i % VAL_EVERY == VAL_EVERY - 1 or (n < VAL_EVERY and i == n - 1)


def log_probs(model: nn.Module, windows: list[list[int]], device: str) -> Tensor:
    """[S * W, V] float32 log-probabilities of the model as it is now, windows as one batch."""
    x = torch.tensor([i for w in windows for i in w], device=device)
    batch = ForwardBatch.build([len(w) for w in windows], [0] * len(windows), None, None, torch.device(device))
    body = model.model
    h, residual = body.embed_tokens(x), None
    for layer in body.layers:
        h, residual = layer(h, residual, batch)
    hidden = body.norm.add_norm(h, residual)[0]  # [T, D]
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


@dataclass
class Target:
    """The teacher's next-token distributions over T positions: log-probabilities logp
    [T, V] (ids and tail None), or those of its top k tokens, logp and ids [T, k] (k < V),
    with the mass of the others, tail [T]."""

    logp: Tensor
    ids: Tensor | None = None
    tail: Tensor | None = None

    @classmethod
    def of(cls, logp: Tensor, topk: int) -> Target:
        """Keep logp [T, V] whole (topk 0 or >= V) or its top `topk` entries and the tail mass."""
        if topk == 0 or topk >= logp.shape[-1]:
            return cls(logp)
        top, ids = logp.topk(topk, dim=-1)  # [T, k]
        tail = logp.scatter(-1, ids, float("-inf")).logsumexp(-1).exp()  # [T]
        return cls(top, ids.int(), tail)

    @classmethod
    def cat(cls, parts: list[Target]) -> Target:
        def join(name: str) -> Tensor | None:
            xs = [getattr(p, name) for p in parts]
            return None if xs[0] is None else torch.cat(xs)
        return cls(join("logp"), join("ids"), join("tail"))

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.logp, self.ids, self.tail) if x is not None)

    def kl(self, logq: Tensor) -> Tensor:
        """Mean over positions of KL(p || q) (top k: the coarsened KL of the module docstring);
        logq [T, V] the student's log-probabilities."""
        if self.ids is None:
            return (self.logp.exp() * (self.logp - logq)).sum(-1).mean()
        ids = self.ids.long()
        top = (self.logp.exp() * (self.logp - logq.gather(-1, ids))).sum(-1)  # [T]
        q_tail = logq.scatter(-1, ids, float("-inf")).logsumexp(-1)  # [T] log of q's mass off the top k
        return (top + torch.xlogy(self.tail, self.tail) - self.tail * q_tail).mean()


def teacher_record(target: list[Target]) -> dict:
    """What lowbit.json records of the teacher: top k (0: all), bytes kept, mean tail mass."""
    if target[0].ids is None:
        return {"top_k": 0, "bytes": sum(t.nbytes for t in target)}
    tail = torch.cat([t.tail for t in target])
    return {"top_k": target[0].ids.shape[-1], "bytes": sum(t.nbytes for t in target),
            "tail_mass_mean": float(tail.mean())}


@torch.inference_mode()
def teacher(model: nn.Module, text: TuneText, device: str, topk: int = TOPK) -> list[Target]:
    """The unquantized model's next-token distributions, one Target per window."""
    return [Target.of(log_probs(model, [w], device), topk) for w in text.windows]


class _Block:
    """One tunable weight: its unit-scale decode, scales and factors, and with `codes` its latent
    unit-scale weight and grid (see the module docstring)."""

    def __init__(self, mod: nn.Module, attr: str, qt: QuantizedTensor, codes: bool = False):
        self.mod, self.attr, self.qt = mod, attr, qt
        s = qt.payload["scales"]
        k = qt.shape[-1]
        unit = QuantizedTensor(qt.format, qt.shape, {**qt.payload, "scales": torch.ones_like(s)})
        u = unit.dequantize(torch.float32)  # [.., N, K]
        self.u = nn.functional.pad(u, (0, s.shape[-1] * BLOCK - k)).reshape(*s.shape, BLOCK)
        self.s = s.float()  # [.., N, NB]
        self.t = torch.zeros_like(self.s, requires_grad=True)
        self.best = torch.zeros_like(self.s)
        group = qt.format.dim if isinstance(qt.format, VqFormat) else 1
        self.grid = _Grid.of(qt) if codes and k % group == 0 else None
        if self.grid is not None:
            self.v = self.u.clone().requires_grad_(True)
            self.idx = self.idx0 = self.best_idx = self.grid.nearest(self.u)[0]

    def scales(self, stored: bool) -> Tensor:
        f = self.t.detach() if stored else self.t
        s = self.s * f.exp()
        return s.to(torch.bfloat16).float() if stored else s

    def install(self, stored: bool) -> None:
        """Put the dense weight under the current factors (and codes) in the module (differentiable
        unless stored)."""
        u = self.u
        if self.grid is not None:
            self.idx, q = self.grid.nearest(self.v.detach(), self.idx)
            u = q if stored else q + (self.v - self.v.detach())
        w = (u * self.scales(stored)[..., None]).flatten(-2)[..., :self.qt.shape[-1]]
        setattr(self.mod, self.attr, w)

    def keep(self) -> None:
        """The current factors and codes are the best so far."""
        self.best = self.t.detach().clone()
        if self.grid is not None:
            self.best_idx = self.idx

    def finish(self) -> None:
        """Put the QuantizedTensor with the kept factors (and codes) back."""
        scales = (self.s * self.best.exp()).to(torch.bfloat16)
        payload = {**self.qt.payload, "scales": scales}
        if self.grid is not None:
            payload["codes"] = self.grid.pack(self.best_idx).reshape(self.qt.payload["codes"].shape)
        setattr(self.mod, self.attr, QuantizedTensor(self.qt.format, self.qt.shape, payload))

    def changed(self) -> int:
        """How many codes the kept step changed (0 without `codes`)."""
        return 0 if self.grid is None else int((self.best_idx != self.idx0).sum())


class _Grid:
    """The values a tunable weight's unit-scale decode can take: each row's table (nf / lut),
    or the codebook's vectors of D weights along K (vq); nearest() maps a latent v
    [.., N, NB, 64] to its indices and values, pack() turns indices into the payload's codes.

    vq, given the current indices (every step after the first): a group searches only its
    current entry c's NEIGHBOURS nearest entries, and only when it may have left c's cell;
    the bounds of the module docstring say when that is exact, other groups search all C."""

    ROWS = 8192  # vq groups per distance matmul of the full search (not lowbit.formats.vq.nearest_entries,
    # whose exact tie-break for byte-identical encodes costs far more on the CPU)
    NEIGHBOURS = 32  # entries a group searches around its current one
    CHUNK = 65536  # groups per [g, NEIGHBOURS, D] gather
    SLACK = 1e-4  # relative margin on both bounds for float32 rounding of the distances

    def __init__(self, fmt, table: Tensor | None, codebook: Tensor | None):
        self.fmt, self.table, self.codebook = fmt, table, codebook
        self.searched = [0, 0, 0]  # vq groups given a start: all, searched among neighbours, searched whole
        if codebook is not None:
            known = codebook_neighbours(fmt.name, self.NEIGHBOURS) if isinstance(fmt, VqFormat) else None
            near = known or neighbours(codebook.cpu(), self.NEIGHBOURS)
            self.near, self.alone, self.reach = (x.to(codebook.device) for x in near)

    @classmethod
    def of(cls, qt: QuantizedTensor) -> _Grid:
        fmt = qt.format
        if isinstance(fmt, VqFormat):
            return cls(fmt, None, fmt.codebook.float().to(qt.payload["scales"].device))
        *lead, n, _ = qt.shape
        return cls(fmt, row_tables(fmt, qt.payload, math.prod(lead), n).reshape(*lead, n, 1, -1), None)

    def nearest(self, v: Tensor, idx: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Indices and values of the grid nearest v; idx: v's indices of the last call (vq: the
        search starts there)."""
        if self.codebook is None:
            grid = self.table.expand(*v.shape[:-1], -1)  # [.., N, NB, T]
            idx = nearest_code(v, grid).long()
            return idx, grid.gather(-1, idx)
        cb = self.codebook  # [C, D]
        x = v.reshape(-1, cb.shape[1])  # [G, D]
        found = self.full(x) if idx is None else self.local(x, idx.reshape(-1))
        return found.reshape(*v.shape[:-1], -1), cb[found].reshape(v.shape)

    def full(self, x: Tensor) -> Tensor:
        """[G] index of the entry nearest each group x [G, D], over all C entries."""
        cb = self.codebook
        norms = cb.pow(2).sum(-1)
        return torch.cat([torch.addmm(norms, x[r:r + self.ROWS], cb.t(), alpha=-2.0).argmin(-1)
                          for r in range(0, x.shape[0], self.ROWS)])

    def local(self, x: Tensor, idx: Tensor) -> Tensor:
        """full(x), found from the current indices idx [G]: a group within alone/2 of its entry
        keeps it; one that may have left searches its entry's neighbours, and the whole codebook
        only when the nearest of them is not provably the nearest of all."""
        cb, out = self.codebook, idx.clone()
        d = (x - cb[idx]).pow(2).sum(-1).sqrt()  # [G] distance to the current entry
        moved = (2 * d * (1 + self.SLACK) > self.alone[idx]).nonzero()[:, 0]
        self.searched[0] += len(idx)
        self.searched[1] += len(moved)
        for part in moved.split(self.CHUNK):
            cur = idx[part]
            cand = self.near[cur]  # [g, M]
            dist, j = (x[part, None] - cb[cand]).pow(2).sum(-1).min(-1)  # [g]
            out[part] = cand.gather(-1, j[:, None])[:, 0]
            unsure = part[(d[part] + dist.sqrt()) * (1 + self.SLACK) > self.reach[cur]]
            if len(unsure):
                out[unsure] = self.full(x[unsure])
                self.searched[2] += len(unsure)
        return out

    def pack(self, idx: Tensor) -> Tensor:
        rows = idx.flatten(-2)  # [.., N, Kp] codes or [.., N, G] indices
        if self.codebook is None:
            return pack_codes(rows.to(torch.uint8), self.fmt.bits)
        return pack_indices(rows, self.fmt.index_bits)


def neighbours(codebook: Tensor, m: int) -> tuple[Tensor, Tensor, Tensor]:
    """For each entry c of codebook [C, D]: near [C, M] its M nearest entries (c first), alone [C]
    the distance to the nearest other entry, reach [C] the distance to the nearest entry not in
    near (inf when M = C). Distances in float64, made once per codebook."""
    c = codebook.shape[0]
    m = min(m, c)
    dist = torch.cdist(codebook.double(), codebook.double())  # [C, C]
    dist.fill_diagonal_(-1.0)  # c ranks first even beside a duplicate of it
    ranked, order = dist.topk(min(m + 1, c), dim=-1, largest=False)  # [C, M + 1] ascending
    ranked = torch.cat([ranked, torch.full_like(ranked[:, :1], math.inf)], -1)  # inf: past the last entry
    return order[:, :m].contiguous(), ranked[:, 1].float(), ranked[:, m].float()


@functools.lru_cache
def codebook_neighbours(name: str, m: int) -> tuple[Tensor, Tensor, Tensor]:
    """neighbours() of a vq format's codebook, made once per run."""
    return neighbours(get_format(name).codebook.float(), m)


class _Norm:
    """An RMSNorm weight g tuned as g * exp(t), stored in the artifact's dtype (`norms`)."""

    def __init__(self, mod: nn.Module, dtype: torch.dtype):
        self.mod, self.dtype = mod, dtype
        self.param = mod._parameters.pop("weight")
        self.g = self.param.data.float()
        self.t = torch.zeros_like(self.g, requires_grad=True)
        self.best = torch.zeros_like(self.g)

    def install(self, stored: bool) -> None:
        g = self.g * (self.t.detach() if stored else self.t).exp()
        self.mod.weight = g.to(self.dtype).float() if stored else g

    def keep(self) -> None:
        self.best = self.t.detach().clone()

    def finish(self) -> None:
        del self.mod.weight
        self.param.data = (self.g * self.best.exp()).to(self.param.dtype)
        self.mod._parameters["weight"] = self.param


def tune_scales(model: nn.Module, text: TuneText, target: list[Target], device: str,
                lr: float = LR, seed: int = 0, norms: torch.dtype | None = None, codes: float = 0.0,
                schedule: str = "constant") -> dict:
    """Tune the block scales of every tunable weight installed in `model` (module docstring),
    with `norms` (the dtype the artifact stores them in) the RMSNorm weights too, and with
    `codes` > 0 (Adam's rate on the latent weights) the codes; `target` is teacher() of the
    same text. `schedule` (SCHEDULES): every group's rate through the steps. Returns what
    lowbit.json records."""
    t0, steps = time.perf_counter(), text.steps
    blocks = [_Block(mod, attr, getattr(mod, attr), codes > 0) for mod, attr in installed(model)]
    if not blocks:  # a --bpw plan of other formats
        return {"method": "block scales tuned on the teacher's KL", "weights": 0, "steps": 0}
    if norms is not None:
        blocks += [_Norm(m, norms) for m in model.modules() if isinstance(m, RMSNorm)]
    val = [i for i in range(len(text.windows)) if text.validation(i)]
    train = [i for i in range(len(text.windows)) if not text.validation(i)]
    val_windows, val_target = [text.windows[i] for i in val], Target.cat([target[i] for i in val])
    groups = [{"params": [b.t for b in blocks]}]
    latent = [b.v for b in blocks if isinstance(b, _Block) and b.grid is not None]
    if latent:
        groups.append({"params": latent, "lr": codes})
    opt = torch.optim.Adam(groups, lr=lr)
    rates = [g["lr"] for g in opt.param_groups]
    gen = torch.Generator().manual_seed(seed)

    def check() -> float:
        with torch.no_grad():
            for b in blocks:
                b.install(stored=True)
            return float(val_target.kl(log_probs(model, val_windows, device)))

    before = best = check()
    print(f"tune-scales: {len(blocks)} tensors, validation KL {before:.5f} before tuning", file=sys.stderr, flush=True)
    best_step, history = 0, [[0, before]]
    try:
        for step in range(1, steps + 1):
            pick = [train[i] for i in torch.randperm(len(train), generator=gen)[:BATCH].tolist()]
            for b in blocks:
                b.install(stored=False)
            logq = log_probs(model, [text.windows[i] for i in pick], device)  # [BATCH * W, V]
            loss = Target.cat([target[i] for i in pick]).kl(logq)
            opt.zero_grad()
            loss.backward()
            if schedule == "cosine":  # step 1 at the full rate, the last at 0
                for g, r in zip(opt.param_groups, rates):
                    g["lr"] = r * 0.5 * (1 + math.cos(math.pi * (step - 1) / max(steps - 1, 1)))
            opt.step()
            if step % EVAL_EVERY == 0 or step == steps:
                score = check()
                history.append([step, score])
                print(f"tune-scales step {step}/{steps}: train KL {loss.item():.5f}, validation KL {score:.5f}, "
                      f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
                if score < best:
                    best, best_step = score, step
                    for b in blocks:
                        b.keep()
    finally:
        changed = sum(b.changed() for b in blocks if isinstance(b, _Block))
        for b in blocks:
            b.finish()
    method = "block scales and codes tuned on the teacher's KL" if latent else "block scales tuned on the teacher's KL"
    grids = [b.grid for b in blocks if isinstance(b, _Block) and b.grid is not None]
    search = dict(zip(("groups", "neighbours", "whole"), map(sum, zip(*(g.searched for g in grids)))))
    extra = {"codes_lr": codes, "code_weights": len(latent), "codes_changed": changed,
             "code_search": search} if latent else {}
    return {"method": method, "steps": steps, "lr": lr, "schedule": schedule, **extra, "batch_windows": BATCH,
            "window": len(text.windows[0]),
            "text": {"file": text.path.name, "sha256": text.sha256, "tokens": sum(map(len, text.windows))},
            "teacher": teacher_record(target),
            "train_windows": len(train), "validation_windows": len(val),
            "validation_kl_before": before, "validation_kl_after": best, "kept_step": best_step,
            "validation_history": history, "weights": sum(isinstance(b, _Block) for b in blocks),
            "norms": sum(isinstance(b, _Norm) for b in blocks),
            "seconds": round(time.perf_counter() - t0, 2)}


def installed(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of every installed weight tuning takes (Linear weights, expert stacks)."""
    return [(mod, attr) for mod in model.modules() for attr in ("weight", "w13", "w2")
            if tunable(mod.__dict__.get(attr))]
