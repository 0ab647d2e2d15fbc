"""Which weights a format replaces, and why the others stay in the compute dtype; what a
loaded model holds in each format. The loader plans quantize-on-load with it; the hybrid
expert plans of lowbit.quantize.policy refine its plan.

Quantized: every Linear weight [N, K] and every expert stack (w13 [E, 2I, D], w2 [E, D, I]),
plus lm_head when asked. Everything else stays dense, each for a listed reason: it is not
a matrix a GEMM reads (embeddings, norms, biases, sinks, router score biases), it decides
routing (router gates), or it is small and feeds every token (MLA's low-rank q_a/kv_a
input projections, lm_head by default).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from torch import nn

from lowbit.errors import LowbitError
from lowbit.formats import Format, QuantizedTensor, get_format
from lowbit.layers.linear import Linear
from lowbit.layers.moe import Experts

ROUTER = r"\.mlp\.(gate|router)\.weight$"
# (pattern on the parameter name, reason it stays dense); first match wins
KEEP_DENSE: tuple[tuple[str, str], ...] = (
    (r"embed_tokens\.weight$", "embedding (a row lookup, not a GEMM)"),
    (ROUTER, "router gate (decides which experts run)"),
    (r"(q_a_proj|kv_a_proj_with_mqa)\.weight$", "MLA low-rank input projection (small, feeds every head)"),
    (r"^lm_head\.weight$", "lm_head (pass --quantize-lm-head to quantize it)"),
    (r"(norm|layernorm)[^.]*\.weight$", "norm scale"),
    (r"(\.bias|\.b13|\.b2)$", "bias"),
    (r"sinks$", "attention sinks"),
    (r"e_score_correction_bias$", "router score bias"),
)


def dense_reason(pname: str) -> str:
    for pattern, reason in KEEP_DENSE:
        if re.search(pattern, pname):
            return reason
    return "not a linear weight"


def swappable(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Parameter name -> (module, attribute) for every weight that may hold a format."""
    out: dict[str, tuple[nn.Module, str]] = {}
    for name, mod in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(mod, (Linear, nn.Linear)) and isinstance(mod._parameters.get("weight"), nn.Parameter):
            if not re.search(ROUTER, f"{prefix}weight"):  # the router reads its weight directly
                out[f"{prefix}weight"] = (mod, "weight")
        elif isinstance(mod, Experts):
            for attr in ("w13", "w2"):
                if isinstance(mod._parameters.get(attr), nn.Parameter):
                    out[f"{prefix}{attr}"] = (mod, attr)
    return out


@dataclass
class QuantPlan:
    """The decision for one model: parameter name -> format, and the dense ones' reasons."""

    quantized: dict[str, Format] = field(default_factory=dict)
    dense: dict[str, str] = field(default_factory=dict)

    def format_of(self, pname: str) -> Format | None:
        return self.quantized.get(pname)


def plan_quantization(model: nn.Module, fmt_name: str, quantize_lm_head: bool = False) -> QuantPlan:
    """Decide, from names and shapes alone (works on a meta-device model), which weights
    take `fmt_name`."""
    fmt = get_format(fmt_name)
    targets = swappable(model)
    plan = QuantPlan()
    for pname, p in model.named_parameters():
        reason = _keep_reason(pname, pname in targets, quantize_lm_head)
        if reason is None:
            reason = _shape_refusal(fmt, tuple(p.shape))
        if reason is None:
            plan.quantized[pname] = fmt
        else:
            plan.dense[pname] = reason
    return plan


def planned_size(model: nn.Module, fmt_name: str, dense_bytes: int = 2) -> dict:
    """What `--quantization fmt_name` would store, from shapes alone (a meta-device model
    will do): quantized weights and their payload bytes, the rest at dense_bytes each."""
    plan = plan_quantization(model, fmt_name)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    q_weights = sum(math.prod(shapes[n]) for n in plan.quantized)
    q_bytes = sum(f.payload_bits(shapes[n]) // 8 for n, f in plan.quantized.items())
    d_weights = sum(math.prod(shapes[n]) for n in plan.dense)
    return {"format": fmt_name, "quantized_weights": q_weights, "quantized_bytes": q_bytes,
            "dense_weights": d_weights, "total_bytes": q_bytes + dense_bytes * d_weights,
            "bits_per_weight": 8 * q_bytes / max(q_weights, 1)}


def _keep_reason(pname: str, is_target: bool, quantize_lm_head: bool) -> str | None:
    reason = dense_reason(pname)
    if not is_target:
        return reason
    if reason == "not a linear weight" or (reason.startswith("lm_head") and quantize_lm_head):
        return None
    return reason


def _shape_refusal(fmt: Format, shape: tuple[int, ...]) -> str | None:
    try:
        fmt.payload_spec(shape)
        fmt.bits_per_weight(shape)
    except LowbitError as e:
        return f"shape {list(shape)} not supported by {fmt.name}: {e}"
    return None


def quantized_weights(model: nn.Module) -> dict[str, QuantizedTensor]:
    """Every QuantizedTensor the model holds, by parameter name."""
    out: dict[str, QuantizedTensor] = {}
    for name, mod in model.named_modules():
        for attr, val in vars(mod).items():
            if isinstance(val, QuantizedTensor):
                out[f"{name}.{attr}" if name else attr] = val
    return out


def describe_weights(model: nn.Module) -> str:
    """"nvfp4 (4.50 bits/weight)" for the quantized weights, "" when there are none."""
    qts = quantized_weights(model)
    if not qts:
        return ""
    names = sorted({q.format.name for q in qts.values()})
    bits = sum(q.nbytes * 8 for q in qts.values()) / sum(math.prod(q.shape) for q in qts.values())
    return f"{'+'.join(names)} ({bits:.2f} bits/weight)"


def bytes_by_format(model: nn.Module) -> dict[str, tuple[int, int]]:
    """format name (or dense dtype) -> (weights, bytes) over the whole model."""
    out: dict[str, list[int]] = {}
    for q in quantized_weights(model).values():
        e = out.setdefault(q.format.name, [0, 0])
        e[0] += math.prod(q.shape)
        e[1] += q.nbytes
    for _, p in model.named_parameters():
        e = out.setdefault(str(p.dtype).replace("torch.", ""), [0, 0])
        e[0] += p.numel()
        e[1] += p.numel() * p.element_size()
    return {k: (v[0], v[1]) for k, v in out.items()}
