"""`lowbit eval`: a model's quality against a teacher on the same tokens, in one process.

Shapes: W window tokens, V vocabulary. The text is tokenized once and cut into windows of
W + 1 tokens overlapping by one, so every token after the first is predicted exactly once
and with at most W - 1 tokens of context. For each window both models run one prefill
(no KV cache) and, per predicted position t, with p the teacher's and q the model's
next-token distribution over the full vocabulary:
  nll_t = -log q[x_{t+1}]          ppl = exp(mean nll)
  kl_t  = sum_v p_v (log p_v - log q_v)      reported as mean and 99th percentile
  top1  = mean [argmax p == argmax q]
Weight error: SQNR = 10 log10(sum w^2 / sum (w - w_hat)^2) over every weight the model
holds in a format, beside the Gaussian rate-distortion bound 6.02 dB per bit.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from lowbit.bench.record import environment
from lowbit.bench.report import plot_kl
from lowbit.checkpoint.loader import LoadedModel, load_model
from lowbit.checkpoint.quant_plan import plan_quantization, quantized_weights, swappable
from lowbit.checkpoint.tokenizer import Tokenizer
from lowbit.engine.batch import ForwardBatch
from lowbit.errors import LowbitError
from lowbit.formats import QuantizedTensor

DB_PER_BIT = 20 * math.log10(2)  # 6.02: Gaussian rate-distortion SQNR per bit
BITS = {"bf16": 16, "fp16": 16, "fp32": 32, "float8_e4m3fn": 8}


@dataclass
class EvalResult:
    model: str
    format: str
    bits_per_weight: float  # over the weights a format may replace (linear weights, experts)
    bytes: int  # every weight of the model, at its storage precision
    ppl: float
    kl_mean: float
    kl_p99: float
    top1: float
    tokens: int
    sqnr_db: float | None = None
    rd_bound_db: float | None = None
    role: str = "model"
    extra: dict = field(default_factory=dict)


def read_text(text_file: str | Path) -> str:
    """The evaluation text, or one sentence saying why it cannot be read."""
    path = Path(text_file)
    if not path.is_file():
        raise LowbitError(f"--text {text_file}: no such file" if not path.exists()
                          else f"--text {text_file} is not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise LowbitError(f"--text {text_file} is not UTF-8 text (byte {e.start}); give a text file") from None
    except OSError as e:
        raise LowbitError(f"--text {text_file} cannot be read: {e.strerror}") from None


def read_tokens(loaded: LoadedModel, text_file: str | Path, max_tokens: int) -> list[int]:
    if loaded.path is None:
        raise LowbitError("eval needs a model directory with a tokenizer (not --random-weights)")
    ids = Tokenizer(loaded.path).encode(read_text(text_file))[: max_tokens + 1]
    if len(ids) < 2:
        raise LowbitError(f"{text_file} gives {len(ids)} token(s); eval needs at least 2")
    return ids


def windows(ids: list[int], width: int) -> list[list[int]]:
    """Chunks of width + 1 tokens sharing one token with the next chunk."""
    return [ids[s:s + width + 1] for s in range(0, len(ids) - 1, width)]


@torch.inference_mode()
def log_probs(model: nn.Module, ids: list[int], device: torch.device) -> torch.Tensor:
    """Next-token log-probabilities [W, V] float32 for the window's inputs ids[:-1]."""
    x = torch.tensor(ids[:-1], device=device)
    batch = ForwardBatch.build([len(x)], [0], None, None, device)
    return torch.log_softmax(model.compute_logits(model(x, batch)).float(), dim=-1)


def weight_bits(loaded: LoadedModel) -> tuple[float, int]:
    """(bits per weight of the weights held in a format, or of the dense checkpoint when
    none is; bytes of all weights, dense ones at the checkpoint's storage precision)."""
    dense_bits = BITS.get(loaded.weight_format.split(" ")[0], 16)
    dense_b = sum(p.numel() for p in loaded.model.parameters()) * dense_bits // 8
    peer = getattr(loaded, "peer_bits", None)  # set by peer_student: its weights stand for codes
    if peer is not None:
        return peer, dense_b
    qts = quantized_weights(loaded.model)
    if not qts:
        return float(dense_bits), dense_b
    q_b = sum(q.nbytes for q in qts.values())
    return q_b * 8 / sum(math.prod(q.shape) for q in qts.values()), q_b + dense_b


def weight_sqnr(teacher: nn.Module, student: nn.Module) -> float | None:
    """SQNR (dB) of the student's weights against the teacher's, over the weights that
    differ in representation (held in a format, or replaced by a peer quantizer)."""
    t_params = dict(teacher.named_parameters())
    sig = noise = 0.0
    found = False
    s_dense = dict(student.named_parameters())
    for name in swappable(teacher):
        w = t_params[name]
        qt = quantized_weights(student).get(name) if name not in s_dense else None
        s = qt if qt is not None else s_dense.get(name)
        if s is None or (isinstance(s, torch.Tensor) and torch.equal(s.float(), w.float())):
            continue
        found = True
        for e in range(w.shape[0]) if w.dim() == 3 else [None]:
            we = (w if e is None else w[e]).double()
            se = s if e is None else s[e]
            se = se.dequantize(torch.float32) if isinstance(se, QuantizedTensor) else se
            sig += float(we.pow(2).sum())
            noise += float((we - se.double().to(we.device)).pow(2).sum())
    if not found:
        return None
    return math.inf if noise == 0 else 10 * math.log10(sig / noise)


def teacher_pass(teacher: LoadedModel, ids: list[int], width: int) -> list[torch.Tensor]:
    """The teacher's log-probabilities per window, kept on the CPU ([W, V] float32 each)
    so several students can be scored against one teacher run."""
    device = next(iter(teacher.model.parameters())).device
    return [log_probs(teacher.model, w, device).cpu() for w in windows(ids, width)]


def evaluate(teacher: LoadedModel, student: LoadedModel, ids: list[int], width: int,
             names: tuple[str, str] = ("teacher", "model"),
             teacher_lp: list[torch.Tensor] | None = None) -> list[EvalResult]:
    """[teacher row, student row] on the same tokens."""
    device = next(iter(student.model.parameters())).device
    lps = teacher_lp if teacher_lp is not None else teacher_pass(teacher, ids, width)
    nll_t, nll_s, kls, top1 = [], [], [], 0
    for w, lp_t in zip(windows(ids, width), lps):
        target = torch.tensor(w[1:], device=device)
        lp_t = lp_t.to(device)  # [W, V]
        lp_s = log_probs(student.model, w, device)
        nll_t.append(-lp_t.gather(1, target[:, None])[:, 0])
        nll_s.append(-lp_s.gather(1, target[:, None])[:, 0])
        kls.append((lp_t.exp() * (lp_t - lp_s)).sum(-1).clamp_min(0))
        top1 += int((lp_t.argmax(-1) == lp_s.argmax(-1)).sum())
    n = sum(len(t) for t in nll_t)
    kl = torch.cat(kls).double().cpu()
    rows = []
    for loaded, nll, name, role in ((teacher, nll_t, names[0], "teacher"), (student, nll_s, names[1], "model")):
        bits, nbytes = weight_bits(loaded)
        same = role == "teacher"
        rows.append(EvalResult(
            model=name, format=loaded.weight_format.split(" (")[0], bits_per_weight=round(bits, 4), bytes=nbytes,
            ppl=math.exp(float(torch.cat(nll).double().mean())),
            kl_mean=0.0 if same else float(kl.mean()),
            kl_p99=0.0 if same else float(torch.quantile(kl, 0.99)),
            top1=1.0 if same else top1 / n, tokens=n, role=role,
        ))
    sq = weight_sqnr(teacher.model, student.model)
    if sq is not None:
        rows[1].sqnr_db = round(sq, 3)
        rows[1].rd_bound_db = round(DB_PER_BIT * rows[1].bits_per_weight, 3)
    return rows


def markdown(rows: list[EvalResult]) -> str:
    head = "| model | format | bits/weight | bytes | PPL | KL mean | KL p99 | top-1 | SQNR dB (bound) | tokens |"
    out = [head, "|" + "---|" * 10]
    for r in rows:
        sq = "-" if r.sqnr_db is None else f"{r.sqnr_db:.2f} ({r.rd_bound_db:.2f})"
        out.append(f"| {r.model} | {r.format} | {r.bits_per_weight:.3f} | {r.bytes / 2**20:.2f} MiB | "
                   f"{r.ppl:.3f} | {r.kl_mean:.5f} | {r.kl_p99:.5f} | {r.top1:.4f} | {sq} | {r.tokens} |")
    return "\n".join(out)


def record(rows: list[EvalResult], args_text: str, seconds: float) -> dict:
    """The JSON record: the student's fields at the top level, both rows under results."""
    student = asdict(rows[-1])
    return {"kind": "eval", **student, "teacher": asdict(rows[0]), "results": [asdict(r) for r in rows],
            "seconds": round(seconds, 2), "command": args_text, "env": environment()}


def peer_student(model: str, spec: str, *, dtype: str, device: str) -> LoadedModel:
    """The model with the weights lowbit would quantize replaced by another quantizer's
    round trip (quantize, dequantize). spec "hqq:BITS:GROUP": HQQ (half-quadratic
    optimisation of scale and zero, groups along K), scale and zero stored in fp16."""
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] != "hqq" or not parts[1].isdigit() or not parts[2].isdigit():
        raise LowbitError(f"--peer {spec!r}: write hqq:BITS:GROUP, e.g. hqq:4:64")
    try:  # imported here: hqq is an optional peer quantizer, not a lowbit dependency
        from hqq.core.quantize import Quantizer
    except ImportError:
        raise LowbitError("--peer hqq needs the hqq package: pip install --no-deps hqq termcolor") from None
    bits, group = int(parts[1]), int(parts[2])
    loaded = load_model(model, dtype=dtype, device=device)
    names = plan_quantization(loaded.model, "nvfp4").quantized  # the same weights lowbit quantizes
    params = dict(loaded.model.named_parameters())
    for name in names:
        w = params[name]
        for m in (w if w.dim() == 3 else [w]):  # one matrix [N, K] at a time
            wq, meta = Quantizer.quantize(m.float(), nbits=bits, group_size=group, optimize=True, axis=1,
                                          device=str(m.device), compute_dtype=torch.float32)
            m.copy_(Quantizer.dequantize(wq, meta).reshape(m.shape).to(m.dtype))
    loaded.weight_format = f"hqq-{bits}b-g{group}"
    loaded.peer_bits = bits + 32 / group  # type: ignore[attr-defined]
    return loaded


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="+", help="students: model directories, artifacts or built-in names "
                   "(several: each is scored on the same tokens, then a KL-vs-bits table)")
    p.add_argument("--teacher", required=True, help="the reference model (usually the bf16 checkpoint)")
    p.add_argument("--text", required=True, help="UTF-8 text file to score")
    p.add_argument("--max-tokens", type=int, default=4096, help="score at most this many tokens")
    p.add_argument("--window", type=int, default=None, help="tokens per window (default: the context, at most 2048)")
    p.add_argument("--json", default=None, help="write the JSON record here ({format} in the path: one per "
                   "student, the format spec or the artifact's directory name)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="draw KL to the teacher against bits per weight for every student (needs matplotlib)")
    p.add_argument("--quantization", default=None,
                   help="quantize the student on load to this format (a comma list scores each in turn)")
    p.add_argument("--quantize-lm-head", action="store_true", help="with --quantization: lm_head too")
    p.add_argument("--peer", default=None, help="student made by another quantizer: hqq:BITS:GROUP (a comma list scores each)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when present)")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto (bf16 on GPU, float32 on CPU)")


def students_of(args: argparse.Namespace) -> list[tuple[str, str, str | None]]:
    """(model, kind, spec) for every student: each model plain, or in each --quantization
    format, then each --peer round trip."""
    out = []
    for model in args.model:
        kinds = [("quantization", q) for q in (args.quantization or "").split(",") if q]
        kinds += [("peer", p) for p in (args.peer or "").split(",") if p]
        out += [(model, kind, spec) for kind, spec in kinds or [("plain", None)]]
    return out


def student_key(model: str, spec: str | None, several_models: bool) -> str:
    """What {format} in --json becomes for a student."""
    name = Path(model).name or str(model)
    key = (spec or "").replace(":", "-")
    return f"{name}-{key}" if several_models and key else key or name


def main_eval(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    if args.max_tokens < 1:
        raise LowbitError(f"--max-tokens must be positive, got {args.max_tokens}")
    read_text(args.text)  # a bad --text fails before two models load
    students = students_of(args)
    if args.json and len(students) > 1 and "{format}" not in args.json:
        raise LowbitError("several students write several records: put {format} in the --json path")
    several = len(args.model) > 1
    keys = [student_key(m, spec, several) for m, _, spec in students]
    if args.json and len(set(keys)) < len(keys):
        raise LowbitError(f"two students would write the same --json record ({', '.join(keys)}); give the "
                          "artifacts directory names of their own")
    teacher = load_model(args.teacher, dtype=dtype, device=device)
    width = args.window or min(teacher.config.max_position_embeddings, 2048)
    ids = read_tokens(teacher, args.text, args.max_tokens)
    cached = teacher_pass(teacher, ids, width)
    scored = []
    for (model, kind, spec), key in zip(students, keys):
        t1 = time.perf_counter()
        if kind == "peer":
            student = peer_student(model, spec, dtype=dtype, device=device)
        else:
            student = load_model(model, dtype=dtype, device=device, quantization=spec,
                                 quantize_lm_head=args.quantize_lm_head)
        if student.config.vocab_size != teacher.config.vocab_size:
            raise LowbitError("the model and the teacher have different vocabularies; eval compares "
                              "next-token distributions, so they must share a tokenizer")
        label = model + {"quantization": f" --quantization {spec}", "peer": f" --peer {spec}"}.get(kind, "")
        rows = evaluate(teacher, student, ids, width, (args.teacher, label), cached)
        print(markdown(rows))
        scored.append(rows[-1])
        if args.json:
            out = Path(args.json.replace("{format}", key))
            rec = record(rows, shlex.join(["lowbit", *sys.argv[1:]]), time.perf_counter() - t1)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(rec, indent=1, default=str) + "\n")
            print(f"wrote {out}")
        del student
    if len(scored) > 1:
        print("\nKL to the teacher by bits per weight:\n"
              + markdown(sorted(scored, key=lambda r: (r.bits_per_weight, r.kl_mean))))
    if args.plot:
        pts = [{"format": r.model, "bits_per_weight": r.bits_per_weight, "kl_mean": r.kl_mean} for r in scored]
        print(f"wrote {plot_kl(pts, Path(args.plot).parent, Path(args.plot).name)}")
    print(f"[{time.perf_counter() - t0:.1f} s, {len(ids) - 1} tokens scored, windows of {width}]")
    return 0
