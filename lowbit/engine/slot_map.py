"""One MoE layer's expert -> slot map with its eviction policy, all in device tensors.

The same admission as lowbit.engine.expert_policy's SlotMap driven by its LRU / LFU /
HotLRU policies, copy for copy, written with fixed shapes and no host read, so that a
decode step inside a CUDA graph admits its own misses (the copies: lowbit.kernels.expert_copy).
The host SlotMap stays the simulator's; tests/engine/test_slot_map.py replays traces through
both and compares every copy.

Shape legend: E experts, S slots.
State (device):
  table     [E + 1] int32    expert -> slot, -1 when not resident (entry E: a write sink)
  owner     [S + 1] int64    slot -> expert, -1 when free (entry S: a write sink)
  last_use  [E] int64        the clock of the expert's last counted use (-1: never)
  count     [E] int64        counted uses (lfu)
  score     [E] float64      decayed routing count (hot-lru): each use adds `weight`, which
                             grows by 1 / HOT_DECAY a step, as the host policy keeps it
  counters  [4] int64        hits, misses, prefetched, prefetch hits
  pending   [E + 1] bool     copied by a prefetch, not used since (entry E: a write sink)
Admission of a needed set N (sorted ascending): each needed expert not resident takes, in
order, the free slots (lowest first), then the slots of resident experts not in N in the
policy's victim order; ties break by expert id, as the host policies do.
"""

from __future__ import annotations

import torch

from lowbit.engine.expert_policy import HOT_DECAY, HOT_SHARE, POLICIES
from lowbit.errors import LowbitError
from lowbit.kernels.runtime import HAS_TRITON
from lowbit.kernels.slot_admit import slot_admit

HITS, MISSES, PREFETCHED, PREFETCH_HITS = range(4)


def _lexsort(keys: list[torch.Tensor]) -> torch.Tensor:
    """Indices sorting by keys[0], then keys[1], ... (stable, most significant first)."""
    order = torch.argsort(keys[-1], stable=True)
    for k in reversed(keys[:-1]):
        order = order[torch.argsort(k[order], stable=True)]
    return order


class DeviceSlotMap:
    def __init__(self, num_slots: int, num_experts: int, policy: str, device: torch.device) -> None:
        if policy not in POLICIES:
            raise LowbitError(f"unknown expert cache policy {policy!r}; use one of {', '.join(POLICIES)}")
        S, E = num_slots, num_experts
        assert 1 <= S <= E, (S, E)
        self.num_slots, self.num_experts, self.policy, self.device = S, E, policy, device
        self.num_hot = int(S * HOT_SHARE) if policy == "hot-lru" else 0
        i64 = dict(dtype=torch.int64, device=device)
        self.table = torch.full((E + 1,), -1, dtype=torch.int32, device=device)
        self.owner = torch.full((S + 1,), -1, **i64)
        self.last_use = torch.full((E,), -1, **i64)
        self.count = torch.zeros(E, **i64)
        self.score = torch.zeros(E, dtype=torch.float64, device=device)
        self.weight = torch.ones((), dtype=torch.float64, device=device)
        self.decay = torch.tensor(HOT_DECAY, dtype=torch.float64, device=device)
        self.clock = torch.zeros((), **i64)
        self.counters = torch.zeros(4, **i64)
        self.pending = torch.zeros(E + 1, dtype=torch.bool, device=device)
        self._slots = torch.arange(S, **i64)
        self._experts = torch.arange(E, **i64)
        # one Triton launch per admission on CUDA (lowbit.kernels.slot_admit); torch ops elsewhere
        self.use_kernel = device.type == "cuda" and HAS_TRITON

    @property
    def slot_table(self) -> torch.Tensor:
        return self.table[:self.num_experts]  # [E] int32, a view

    def needed_mask(self, ids: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        """[E] bool: the experts named by ids [T, A] (rows where live [T, 1] is False, and
        ids outside 0..E-1, name nothing)."""
        ok = (ids >= 0) & (ids < self.num_experts)
        if live is not None:
            ok = ok & live
        sink = torch.where(ok, ids.long(), self.num_experts).reshape(-1)
        mask = torch.zeros(self.num_experts + 1, dtype=torch.bool, device=ids.device)
        return mask.index_fill_(0, sink, True)[:self.num_experts]

    def _hot(self) -> torch.Tensor:
        """[E] bool: the top num_hot experts by score (ties: lower id), score > 0."""
        s = self.score
        ahead = (s[None, :] > s[:, None]) | ((s[None, :] == s[:, None])
                                             & (self._experts[None, :] < self._experts[:, None]))
        return (ahead.sum(1) < self.num_hot) & (s > 0)

    def _victim_key(self, e: torch.Tensor) -> list[torch.Tensor]:
        """The policy's victim order of experts e (smallest first), before the id tie-break."""
        if self.policy == "lfu":
            return [self.count[e], self.last_use[e]]
        if self.policy == "hot-lru" and self.num_hot:
            return [self._hot()[e].long(), self.last_use[e]]
        return [self.last_use[e]]

    def admit_routed(self, ids: torch.Tensor, w: torch.Tensor,
                     live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """admit() of the experts that rows below live (a device scalar) of ids [T, A] name;
        returns (pairs, slot ids [T, A] int32, weights [T, A]): a padding row reads slots
        0..A-1 (distinct, as the fused MoE needs) at weight 0."""
        T, A = ids.shape
        if not self.use_kernel:
            rows = torch.arange(T, device=ids.device)[:, None] < live  # [T, 1]
            pairs = self.admit(self.needed_mask(ids, rows))
            pad = torch.arange(A, dtype=torch.int32, device=ids.device).expand(T, A)
            sid = torch.where(rows, self.table[ids.long().clamp(0, self.num_experts)], pad)
            return pairs, sid, torch.where(rows, w, torch.zeros_like(w))
        pairs = torch.empty(self.num_slots, 2, dtype=torch.int64, device=self.device)
        sid = torch.empty(T, A, dtype=torch.int32, device=self.device)
        w = w.float().contiguous()
        slot_admit(self, self.policy, self.num_hot, pairs, ids=ids.contiguous(), live=live, sid=sid, w=w)
        return pairs, sid, w

    def admit(self, needed: torch.Tensor, count: bool = True) -> torch.Tensor:
        """Make the experts of needed [E] bool resident (at most S of them). Returns the
        copies to make, [S, 2] int64 rows (expert, slot), -1 past the last one."""
        if self.use_kernel:
            pairs = torch.empty(self.num_slots, 2, dtype=torch.int64, device=self.device)
            slot_admit(self, self.policy, self.num_hot, pairs, needed=needed.contiguous(), count=count)
            return pairs
        S, E = self.num_slots, self.num_experts
        resident = self.slot_table >= 0
        miss = needed & ~resident  # [E]
        n_miss = miss.sum()
        own = self.owner[:S]  # [S]
        free = own < 0
        e = own.clamp(min=0)
        group = torch.where(free, 0, torch.where(needed[e], 2, 1))  # free, evictable, kept
        keys = [k.masked_fill(free, 0) for k in self._victim_key(e)]
        order = _lexsort([group, *keys, torch.where(free, self._slots, e)])  # [S] slots, best first
        first = torch.argsort((~miss).to(torch.int8), stable=True)[:S]  # misses ascending, then others
        valid = self._slots < n_miss
        experts = torch.where(valid, first, -1)
        slots = torch.where(valid, order, -1)
        old = torch.where(valid, self.owner[order], -1)  # evicted experts (-1: a free slot)
        gone = torch.where(old >= 0, old, E)
        self.table.index_fill_(0, gone, -1)
        self.pending.index_fill_(0, gone, False)
        self.table.index_copy_(0, torch.where(valid, first, E), slots.to(torch.int32))
        self.owner.index_copy_(0, torch.where(valid, order, S), experts)
        self.table[E:].fill_(-1)  # fill_ with a scalar: no host tensor copied to the device
        self.owner[S:].fill_(-1)
        if count:
            self._touch(needed, n_miss)
        else:
            self.counters[PREFETCHED] += n_miss
            self.pending[:E] |= miss
        return torch.stack((experts, slots), 1)

    def _touch(self, needed: torch.Tensor, n_miss: torch.Tensor) -> None:
        n, pending = needed.sum(), self.pending[:self.num_experts]
        self.counters[PREFETCH_HITS] += (pending & needed).sum()
        pending &= ~needed
        self.counters[HITS] += n - n_miss
        self.counters[MISSES] += n_miss
        self.touch(needed)

    def touch(self, used: torch.Tensor) -> None:
        """A step's uses [E] bool: recency, counts and decayed scores, as Policy.touch."""
        self.clock += 1
        self.last_use.copy_(torch.where(used, self.clock, self.last_use))
        self.count += used.long()
        self.weight /= self.decay  # a device tensor: torch divides a CUDA tensor by a host
        # scalar as a multiply by its reciprocal, which rounds apart from the kernel's division
        self.score += used.double() * self.weight
        big = self.weight > 1e100  # renormalise before float overflow, as the host policy does
        self.score.copy_(torch.where(big, self.score / self.weight, self.score))
        self.weight.copy_(torch.where(big, torch.ones_like(self.weight), self.weight))

    STATE = ("table", "owner", "last_use", "count", "score", "weight", "clock", "counters", "pending")

    def state(self) -> list[torch.Tensor]:
        """A copy of every state tensor (a graph's warm-up step admits, then puts it back)."""
        return [getattr(self, k).clone() for k in self.STATE]

    def load(self, state: list[torch.Tensor]) -> None:
        for k, t in zip(self.STATE, state):
            getattr(self, k).copy_(t)  # in place: captured graphs hold these tensors

    def free(self, slots: torch.Tensor) -> None:
        """Mark slots [M] (-1: none) free, their experts no longer resident: slots whose
        contents changed behind the map's back (a warm-up step's copies, its state put back)."""
        S, E = self.num_slots, self.num_experts
        s = torch.where(slots >= 0, slots, S)
        old = self.owner[s]  # -1 where free or none
        gone = torch.where(old >= 0, old, E)
        self.table.index_fill_(0, gone, -1)
        self.pending.index_fill_(0, gone, False)
        self.owner.index_fill_(0, s, -1)
        self.table[E:].fill_(-1)  # `t[E] = -1` would copy a host scalar: a sync under capture

    def stats(self) -> dict[str, int]:
        """The counters on the host (a read: for telemetry, not inside a step)."""
        h, m, p, ph = self.counters.tolist()
        return {"hits": h, "misses": m, "prefetched": p, "prefetch_hits": ph}

    def owners(self) -> list[int]:
        return self.owner[:self.num_slots].tolist()
