"""Which experts an expert cache keeps: eviction policies, the slot map they drive, routing
traces, and a simulator that replays a trace through a policy (no GPU, no model).

One cache per MoE layer holds S slots. A step needs a set of experts per layer (the unique
ids its tokens were routed to); each needed expert that is resident is a hit, each other a
miss that evicts one resident expert the step does not need. Counts are per expert and
step, because a miss copies an expert once however many tokens read it.

Policies see every access (`touch`) and pick a victim among the evictable experts (ties
go to the lowest expert id):
  lru       least recently used
  lfu       least often used over the whole run (ties: least recently used)
  hot-lru   LRU, except that the experts routed to most often (a decayed count) and
            filling `HOT_SHARE` of the slots are pinned; the default
  belady    the offline optimum (evict the expert used furthest in the future): the
            simulator's yardstick, it needs the whole trace
  a0        evict the expert the whole trace uses least (its counts known in advance): the
            best demand policy when each step's experts are drawn independently of the
            steps before (the independent reference model; Aho, Denning and Ullman's A0).
            The simulator's second yardstick: on such a trace no online policy beats it,
            however far it stays under Belady, who also knows the order of the draws

A routing trace is JSON lines: a header {"num_experts", "top_k", "moe_layers"}, then one
line per step {"step": n, "ids": [per MoE layer: [per token: expert ids]]} and, when the
engine predicted the next layer's experts (pre-gating), "pred": [per MoE layer: expert ids
predicted for the next MoE layer].
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lowbit.errors import LowbitError

HOT_SHARE = 0.75  # share of the slots hot-lru pins to the most routed experts (tuned: docs/SERVING.md)
HOT_DECAY = 0.99  # per-step decay of hot-lru's routing counts (about the last 100 steps)


class Policy:
    """Eviction policy of one layer's cache. `touch` sees the experts a step uses, in step
    order; `victim` picks one of `candidates` (resident, unused by this step) to evict."""

    def __init__(self, num_slots: int, num_experts: int) -> None:
        self.num_slots, self.num_experts = num_slots, num_experts
        self.clock = 0
        self.last_use = [-1] * num_experts

    def touch(self, experts: Iterable[int]) -> None:
        self.clock += 1
        for e in experts:
            self.last_use[e] = self.clock

    def victim(self, candidates: Sequence[int]) -> int:
        raise NotImplementedError


class LRU(Policy):
    def victim(self, candidates: Sequence[int]) -> int:
        return min(candidates, key=lambda e: (self.last_use[e], e))


class LFU(Policy):
    def __init__(self, num_slots: int, num_experts: int) -> None:
        super().__init__(num_slots, num_experts)
        self.count = [0] * num_experts

    def touch(self, experts: Iterable[int]) -> None:
        experts = list(experts)
        super().touch(experts)
        for e in experts:
            self.count[e] += 1

    def victim(self, candidates: Sequence[int]) -> int:
        return min(candidates, key=lambda e: (self.count[e], self.last_use[e], e))


class HotLRU(Policy):
    """LRU over the experts that are not hot; hot = the top HOT_SHARE x slots by a decayed
    routing count. When every candidate is hot, the least recently used of them goes."""

    def __init__(self, num_slots: int, num_experts: int) -> None:
        super().__init__(num_slots, num_experts)
        self.score = [0.0] * num_experts
        self.num_hot = int(num_slots * HOT_SHARE)
        self.weight = 1.0  # decay as a growing increment: no per-step pass over all experts

    def touch(self, experts: Iterable[int]) -> None:
        experts = list(experts)
        super().touch(experts)
        self.weight /= HOT_DECAY
        for e in experts:
            self.score[e] += self.weight
        if self.weight > 1e100:  # renormalise before float overflow
            self.score = [s / self.weight for s in self.score]
            self.weight = 1.0

    def hot(self) -> set[int]:
        ranked = sorted(range(self.num_experts), key=lambda e: -self.score[e])
        return {e for e in ranked[:self.num_hot] if self.score[e] > 0}

    def victim(self, candidates: Sequence[int]) -> int:
        hot = self.hot() if self.num_hot else set()
        cold = [e for e in candidates if e not in hot] or list(candidates)
        return min(cold, key=lambda e: (self.last_use[e], e))


class Belady(Policy):
    """Offline optimum: `future[e]` lists the clocks at which expert e is used, ascending."""

    def __init__(self, num_slots: int, num_experts: int, future: list[list[int]]) -> None:
        super().__init__(num_slots, num_experts)
        self.future = future
        self.cursor = [0] * num_experts

    def next_use(self, e: int) -> float:
        uses, i = self.future[e], self.cursor[e]
        while i < len(uses) and uses[i] <= self.clock:
            i += 1
        self.cursor[e] = i
        return uses[i] if i < len(uses) else float("inf")

    def victim(self, candidates: Sequence[int]) -> int:
        return max(candidates, key=lambda e: (self.next_use(e), -e))


class A0(Policy):
    """Evict the least used expert of the whole trace (`counts`, known in advance)."""

    def __init__(self, num_slots: int, num_experts: int, counts: list[int]) -> None:
        super().__init__(num_slots, num_experts)
        self.counts = counts

    def victim(self, candidates: Sequence[int]) -> int:
        return min(candidates, key=lambda e: (self.counts[e], self.last_use[e], e))


POLICIES = {"lru": LRU, "lfu": LFU, "hot-lru": HotLRU}
DEFAULT_POLICY = "hot-lru"
SIM_POLICIES = (*POLICIES, "a0", "belady")


def make_policy(name: str, num_slots: int, num_experts: int) -> Policy:
    if name not in POLICIES:
        raise LowbitError(f"unknown expert cache policy {name!r}; use one of {', '.join(POLICIES)}")
    return POLICIES[name](num_slots, num_experts)


@dataclass
class SlotMap:
    """expert -> slot of one layer's cache, driven by a policy. `admit(needed)` makes every
    needed expert resident and returns the (expert, slot) copies to make."""

    num_slots: int
    policy: Policy
    slot_of: dict[int, int] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def admit(self, needed: Iterable[int], count: bool = True) -> list[tuple[int, int]]:
        needed = sorted(set(needed))
        if len(needed) > self.num_slots:
            raise ValueError(f"{len(needed)} experts needed at once, {self.num_slots} slots")
        copies = []
        free = sorted(set(range(self.num_slots)) - set(self.slot_of.values()))
        for e in needed:
            if e in self.slot_of:
                continue
            if free:
                slot = free.pop(0)
            else:
                gone = self.policy.victim([r for r in self.slot_of if r not in needed])
                slot = self.slot_of.pop(gone)
            self.slot_of[e] = slot
            copies.append((e, slot))
        if count:
            self.misses += len(copies)
            self.hits += len(needed) - len(copies)
            self.policy.touch(needed)
        return copies


# -- routing traces ----------------------------------------------------------------------
@dataclass
class RoutingTrace:
    num_experts: int
    top_k: int
    moe_layers: list[int]
    steps: list[list[list[list[int]]]] = field(default_factory=list)  # [step][layer][token] ids
    preds: list[list[list[int]] | None] = field(default_factory=list)  # [step][layer] predicted ids

    def needed(self, step: int, layer: int) -> list[int]:
        return sorted({e for tok in self.steps[step][layer] for e in tok})


def write_header(f, num_experts: int, top_k: int, moe_layers: list[int]) -> None:
    f.write(json.dumps({"num_experts": num_experts, "top_k": top_k, "moe_layers": moe_layers}) + "\n")


def write_step(f, step: int, ids: list[list[list[int]]], pred: list[list[int]] | None) -> None:
    line = {"step": step, "ids": ids}
    if pred is not None:
        line["pred"] = pred
    f.write(json.dumps(line, separators=(",", ":")) + "\n")


def load_trace(path: str | Path) -> RoutingTrace:
    lines = Path(path).read_text().splitlines()
    if not lines:
        raise LowbitError(f"{path} is empty: record a trace with --record-routing FILE")
    try:
        head = json.loads(lines[0])
        trace = RoutingTrace(int(head["num_experts"]), int(head["top_k"]), list(head["moe_layers"]))
        for line in lines[1:]:
            row = json.loads(line)
            trace.steps.append(row["ids"])
            trace.preds.append(row.get("pred"))
    except (ValueError, KeyError, TypeError) as e:
        raise LowbitError(f"{path} is not a routing trace written by --record-routing ({e})") from None
    return trace


# -- the simulator -----------------------------------------------------------------------
@dataclass
class SimResult:
    policy: str
    slots: int
    hits: int
    misses: int
    per_layer: list[float]  # hit rate per MoE layer
    prefetch_hits: int = 0  # misses a pre-gating prefetch turned into hits
    prefetched: int = 0  # copies the prefetch made (useful or not)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)


def _accesses(trace: RoutingTrace, layer: int, slots: int) -> list[tuple[int, list[int]]]:
    """(step, experts) in the order a cache sees them: a step needing more experts than
    there are slots is served in groups of `slots`."""
    out = []
    for t in range(len(trace.steps)):
        needed = trace.needed(t, layer)
        out += [(t, needed[i:i + slots]) for i in range(0, len(needed), slots)]
    return out


def _future(accesses: list[tuple[int, list[int]]], num_experts: int) -> list[list[int]]:
    uses: list[list[int]] = [[] for _ in range(num_experts)]
    for i, (_, group) in enumerate(accesses):
        for e in group:
            uses[e].append(i + 1)  # the policy's clock after this access's touch
    return uses


def simulate(trace: RoutingTrace, slots: int, policy: str, prefetch: bool = False) -> SimResult:
    """Replay `trace` through one cache of `slots` per MoE layer. With `prefetch`, a layer's
    predicted experts (the trace's "pred" of the previous MoE layer, most likely first) are
    admitted before its step, uncounted, as the engine's pre-gating does."""
    if policy not in SIM_POLICIES:
        raise LowbitError(f"unknown policy {policy!r}; use one of {', '.join(SIM_POLICIES)}")
    if not isinstance(slots, int) or slots < 1:
        raise LowbitError(f"--slots must be a positive integer, got {slots}")
    n_layers = len(trace.steps[0]) if trace.steps else 0
    hits = misses = pre_hits = prefetched = 0
    per_layer = []
    for layer in range(n_layers):
        accesses, E = _accesses(trace, layer, slots), trace.num_experts
        if policy == "belady":
            pol = Belady(slots, E, _future(accesses, E))
        elif policy == "a0":
            pol = A0(slots, E, [len(uses) for uses in _future(accesses, E)])
        else:
            pol = make_policy(policy, slots, E)
        cache = SlotMap(slots, pol)
        last_step = -1
        for t, group in accesses:
            guessed: set[int] = set()
            pred = trace.preds[t][layer - 1] if prefetch and layer and trace.preds[t] else None
            if pred and t != last_step:  # as the engine does: at most half the slots
                guessed = {e for e, _ in cache.admit(pred[:max(1, slots // 2)], count=False)}
                prefetched += len(guessed)
            last_step = t
            cache.admit(group)
            pre_hits += sum(1 for e in group if e in guessed)
        hits, misses = hits + cache.hits, misses + cache.misses
        per_layer.append(cache.hits / max(1, cache.hits + cache.misses))
    return SimResult(policy, slots, hits, misses, per_layer, pre_hits, prefetched)
