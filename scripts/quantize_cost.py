"""What `lowbit quantize --calib` costs for one decoder layer at a real model's shape.

    python scripts/quantize_cost.py [--config lowbit/model_configs/Qwen__Qwen3-30B-A3B.json]
        [--tokens 4096] [--formats nvfp4,vq3] [--experts vq3:16] [--device cpu] [--json FILE]

One layer of the config (attention q/k/v/o, router gate, E experts' w13 and w2), random
bf16 weights ~ N(0, 0.02) and unit norms, held in float32 as the pipeline holds the model.
Hessians: N random hidden states ~ N(0, 1) through the layer in windows of 1,024 under the
pipeline's hooks (lowbit.quantize.calibrate.hessian_hooks), so each expert sees the tokens
the random router sends it, and one routed fewer than MIN_TOKENS takes the layer's pooled
Hessian. Then, per weight group and format, round-to-nearest (`fmt.quantize`) and GPTQ
(lowbit.quantize.gptq_vq.calibrated_rounding, damping 0.01, as `calibrated_quantize` calls
it). `--experts F:M` rounds the experts of format F on the first M only and scales their
times by E / M. Each step reports wall seconds, CPU seconds (the process, all threads) and
peak memory: on cpu the process's peak resident set during the step (VmHWM, reset before
it), on cuda the peak allocated; also the peak above what was held when the step began.
Prints a markdown table for docs/BENCHMARKS.md and the whole model's cost at that many
layers (rounding times the layer's, Hessians held for every layer as the pipeline holds them).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lowbit.checkpoint.quant_plan import QuantPlan
from lowbit.engine.batch import ForwardBatch
from lowbit.formats import get_format
from lowbit.layers.norm import RMSNorm
from lowbit.models import build_model
from lowbit.models.config import ArchConfig
from lowbit.quantize.calibrate import MIN_TOKENS, WINDOW, HessianSums, hessian_hooks
from lowbit.quantize.gptq_vq import calibrated_rounding

CONFIG = "lowbit/model_configs/Qwen__Qwen3-30B-A3B.json"
GROUPS = {"attention q/k/v/o": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                "self_attn.v_proj.weight", "self_attn.o_proj.weight"),
          "experts w13": ("mlp.experts.w13",), "experts w2": ("mlp.experts.w2",)}


class Meter:
    """Wall, CPU and peak memory of one step (see the module docstring)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def __enter__(self) -> Meter:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # peak resident set := current
            self.base = _status_bytes("VmRSS")
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        self.peak = torch.cuda.max_memory_allocated() if self.cuda else _status_bytes("VmHWM")
        self.extra = self.peak - self.base

    def record(self, scale: float = 1.0) -> dict:
        return {"wall_s": self.wall * scale, "cpu_s": self.cpu * scale, "peak_bytes": self.peak,
                "peak_above_start_bytes": self.extra}


def _status_bytes(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def one_layer(raw: dict, device: str) -> torch.nn.Module:
    """Layer 0 of the config's model (a tiny vocabulary: only the layer is used), random weights."""
    cfg = ArchConfig.from_dict({**raw, "num_hidden_layers": 1, "vocab_size": 16, "max_position_embeddings": WINDOW})
    with torch.device(device):
        model = build_model(cfg)
    gen = torch.Generator(device).manual_seed(0)
    layer = model.model.layers[0]
    for mod in layer.modules():
        for p in mod.parameters(recurse=False):
            if isinstance(mod, RMSNorm):
                p.data.fill_(1.0)
            else:
                p.data.copy_((torch.randn(p.shape, generator=gen, device=device) * 0.02).bfloat16())
    return layer


def hessians(layer: torch.nn.Module, tokens: int, device: str) -> HessianSums:
    plan = QuantPlan({p: get_format("nvfp4") for ps in GROUPS.values() for p in ps})
    sums = HessianSums()
    gen = torch.Generator(device).manual_seed(1)
    d = layer.input_layernorm.weight.shape[0]
    with hessian_hooks(layer, plan, sums), torch.inference_mode():
        for s in range(0, tokens, WINDOW):
            n = min(WINDOW, tokens - s)
            h = torch.randn(n, d, generator=gen, device=device)  # [T, D] the layer's input
            sums.tokens += n
            layer(h, None, ForwardBatch.build([n], [0], None, None, torch.device(device)))
    return sums


def round_group(layer: torch.nn.Module, sums: HessianSums, names: tuple[str, ...], fmt_name: str,
                experts: int | None, device: str) -> dict:
    """RTN and GPTQ of the group's weights (the first `experts` of a stack), timed; the
    Hessians' means (the pipeline's `sums.mean`) are taken before the clock starts."""
    fmt, params = get_format(fmt_name), dict(layer.named_parameters())
    weights = [(params[n].data, sums.mean(n)) for n in names]
    scale = 1.0
    if experts is not None and experts < weights[0][0].shape[0]:
        scale = weights[0][0].shape[0] / experts
        weights = [(w[:experts], h[:experts]) for w, h in weights]
    out = {}
    for how in ("rtn", "gptq"):
        with Meter(device) as m:
            for w, h in weights:
                qt = fmt.quantize(w) if how == "rtn" else calibrated_rounding(fmt, w, h)
                del qt
        out[how] = m.record(scale) | {"experts_timed": experts if scale != 1.0 else None}
    return out


def table(rec: dict) -> str:
    rows = ["| step | format | rounding | wall s | CPU s | peak resident GiB | above start GiB |",
            "|---|---|---|---|---|---|---|"]
    h = rec["hessians"]
    rows.append(f"| Hessian pass, {rec['tokens']:,} tokens | - | - | {h['wall_s']:.1f} | {h['cpu_s']:.1f} | "
                f"{h['peak_bytes'] / 2**30:.2f} | {h['peak_above_start_bytes'] / 2**30:.2f} |")
    for group, per in rec["rounding"].items():
        for fmt, res in per.items():
            for how, r in res.items():
                note = f" (first {r['experts_timed']} experts, x{rec['experts'] / r['experts_timed']:.0f})" \
                    if r["experts_timed"] else ""
                rows.append(f"| {group}{note} | {fmt} | {how.upper()} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
                            f"{r['peak_bytes'] / 2**30:.2f} | {r['peak_above_start_bytes'] / 2**30:.2f} |")
    return "\n".join(rows)


def whole_model(rec: dict) -> str:
    n, lines = rec["layers"], []
    for fmt in rec["formats"]:
        for how in ("rtn", "gptq"):
            s = sum(per[fmt][how]["wall_s"] for per in rec["rounding"].values())
            lines.append(f"{fmt} {how.upper()}: {s:.0f} s a layer, {n} layers {n * s / 3600:.2f} h")
    hb = rec["hessian_bytes"]
    lines.append(f"Hessians held: {hb / 2**30:.2f} GiB a layer, {n * hb / 2**30:.0f} GiB for {n} layers; "
                 f"Hessian pass {rec['hessians']['wall_s']:.0f} s a layer at {rec['tokens']:,} tokens")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--tokens", type=int, default=4096, help="random hidden states for the Hessians")
    ap.add_argument("--formats", default="nvfp4,vq3")
    ap.add_argument("--experts", default="", help="F:M,... round format F's experts on the first M only")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="write the record here")
    args = ap.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    subset = {f: int(m) for f, m in (x.split(":") for x in args.experts.split(",") if x)}
    t0 = time.perf_counter()
    raw = json.loads(Path(args.config).read_text())
    layer = one_layer(raw, args.device)
    with Meter(args.device) as m:
        sums = hessians(layer, args.tokens, args.device)
    counts = sums.n["mlp.experts.w13"]
    rec = {"config": args.config, "device": args.device, "tokens": args.tokens, "layers": raw["num_hidden_layers"],
           "experts": raw["num_experts"], "formats": formats, "threads": torch.get_num_threads(),
           "hessians": m.record(), "hessian_bytes": sum(h.nbytes for h in sums.h.values()),
           "tokens_per_expert": {"min": int(counts.min()), "median": int(counts.median()), "max": int(counts.max()),
                                 "pooled_below_min_tokens": int((counts < MIN_TOKENS).sum())},
           "rounding": {}}
    print(f"Hessians: {m.wall:.1f} s; tokens per expert {rec['tokens_per_expert']}", flush=True)
    for group, names in GROUPS.items():
        for fmt in formats:
            experts = subset.get(fmt) if group.startswith("experts") else None
            rec["rounding"].setdefault(group, {})[fmt] = round_group(layer, sums, names, fmt, experts, args.device)
            r = rec["rounding"][group][fmt]
            print(f"{group} {fmt}: RTN {r['rtn']['wall_s']:.1f} s, GPTQ {r['gptq']['wall_s']:.1f} s", flush=True)
    steps = [rec["hessians"]] + [r for per in rec["rounding"].values() for res in per.values() for r in res.values()]
    rec["process_peak_bytes"] = max(r["peak_bytes"] for r in steps)
    rec["seconds"] = time.perf_counter() - t0
    print(table(rec))
    print(whole_model(rec))
    if args.json:
        Path(args.json).write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
