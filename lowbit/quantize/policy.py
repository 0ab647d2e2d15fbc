"""Hybrid expert stacks: hot experts in one format, cold ones in another, refining the plan
of lowbit.checkpoint.quant_plan (which weights a format replaces)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lowbit.checkpoint.quant_plan import QuantPlan, swappable
from lowbit.errors import LowbitError
from lowbit.formats import Format, get_format
from lowbit.formats.hybrid import HybridTensor
from lowbit.layers.moe import Experts


@dataclass
class HybridSpec:
    """`--hybrid hot=nvfp4:K,cold=nf3`: per expert stack, the K hottest experts take the hot
    format, the rest the cold one. `order` lists experts hottest first, per layer prefix
    (e.g. from `router_frequency` over a calibration pass) or under "" for every layer; a
    layer with no order takes experts 0 .. K-1 as hot."""

    hot_format: str
    hot_count: int
    cold_format: str
    order: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> HybridSpec:
        try:
            kv = dict(item.split("=", 1) for item in text.replace(" ", "").split(","))
            hot_fmt, count = kv["hot"].split(":")
            spec = cls(hot_fmt, int(count), kv["cold"])
        except (KeyError, ValueError):
            raise LowbitError(f"--hybrid {text!r}: write hot=FORMAT:K,cold=FORMAT "
                              "(e.g. hot=nvfp4:16,cold=nf3)") from None
        get_format(spec.hot_format), get_format(spec.cold_format)  # unknown names raise here
        if spec.hot_count < 0:
            raise LowbitError(f"--hybrid {text!r}: K must be >= 0")
        return spec

    def hot_experts(self, pname: str, n_experts: int) -> list[int]:
        prefix = pname.rsplit(".experts.", 1)[0]
        order = self.order.get(prefix, self.order.get("", list(range(n_experts))))
        return sorted(order[: min(self.hot_count, n_experts)])


def router_frequency(topk_ids, n_experts: int) -> list[int]:
    """Experts hottest first from calibration routing ids [T, A] (ties: lower id first)."""
    counts = torch.bincount(topk_ids.reshape(-1).long().cpu(), minlength=n_experts)
    return sorted(range(n_experts), key=lambda e: (-int(counts[e]), e))


@dataclass
class HybridFormat:
    """A planned format for one expert stack: quantize(w [E, N, K]) -> HybridTensor."""

    hot: Format
    cold: Format
    hot_ids: list[int]
    name: str = "hybrid"

    def quantize(self, w):
        cold_ids = [e for e in range(w.shape[0]) if e not in set(self.hot_ids)]
        parts, members = {}, {}
        for part, fmt, ids in (("hot", self.hot, self.hot_ids), ("cold", self.cold, cold_ids)):
            if ids:
                parts[part] = fmt.quantize(w[ids].contiguous())
                members[part] = ids
        return HybridTensor(tuple(w.shape), parts, members)


def plan_hybrid(model: nn.Module, plan: QuantPlan, spec: HybridSpec) -> QuantPlan:
    """Re-plan every expert stack of `plan` as a HybridFormat of `spec` (other weights keep
    their plan). The loader's quantize-on-load path then encodes each stack by parts."""
    hot, cold = get_format(spec.hot_format), get_format(spec.cold_format)
    for pname, (mod, _attr) in swappable(model).items():
        if isinstance(mod, Experts) and pname in plan.quantized:
            n = mod.w13.shape[0]
            plan.quantized[pname] = HybridFormat(hot, cold, spec.hot_experts(pname, n))
    return plan
