"""The expert cache's admission in one launch: lowbit.engine.slot_map.DeviceSlotMap.admit
(its torch twin, ~70 small ops) as a single Triton program, so that a decode graph pays one
node per MoE layer for it. Same state, same choices, bit for bit (float64 scores included).

Shape legend: E experts (EP: next power of 2), S slots (SP), T tokens, A top-k.
Inputs: the step's routed ids [T, A] (rows at or past live[0] name nothing) or a needed
mask [E]; the slot map's state tensors (slot_map.py's docstring). Output: pairs [S, 2]
(expert, slot) of the copies to make, -1 past the last; with ids, also the step's slot ids
[T, A] (padding rows: slots 0..A-1, distinct as the fused MoE needs) and the routing
weights [T, A] with padding rows zeroed.
Victim order of the slots: free ones first (by slot), then the evictable ones (owner not
needed) by the policy's key, then the owner's id; rank r of that order takes the miss of
rank r (misses by ascending id). Ranks and gathers are one-hot comparisons over [SP, EP]
and [SP, SP] tiles: E and S are at most a few hundred.
Invariant: the needed experts fit the slots (at most S), as the caller guarantees.
"""

from __future__ import annotations

import torch

from lowbit.kernels.runtime import tl, triton

LRU, LFU, HOT_LRU = 0, 1, 2
POLICY_CODES = {"lru": LRU, "lfu": LFU, "hot-lru": HOT_LRU}


@triton.jit
def _gather(onehot, v):
    """v [EP] gathered at each row's expert of onehot [SP, EP] (0 where none)."""
    return tl.sum(tl.where(onehot, v[None, :], 0), 1)


@triton.jit
def _slot_admit_kernel(ids_ptr, TA, A, live_ptr, mask_ptr, sid_ptr, w_ptr,
                       table_ptr, owner_ptr, last_use_ptr, count_ptr, score_ptr, weight_ptr,
                       decay_ptr, clock_ptr, counters_ptr, pending_ptr, pairs_ptr,
                       E, S, num_hot,
                       POLICY: tl.constexpr, FROM_IDS: tl.constexpr, COUNT: tl.constexpr,
                       EP: tl.constexpr, SP: tl.constexpr, TAP: tl.constexpr):
    ev = tl.arange(0, EP)
    em = ev < E
    sv = tl.arange(0, SP)
    sm = sv < S
    if FROM_IDS:
        i = tl.arange(0, TAP)
        live = tl.load(live_ptr)
        ok = (i < TA) & ((i // A) < live)
        ids = tl.load(ids_ptr + i, mask=ok, other=-1)
        needed = tl.max((ids[:, None] == ev[None, :]).to(tl.int32), 0) > 0  # [EP]
    else:
        needed = tl.load(mask_ptr + ev, mask=em, other=0) != 0
    needed = needed & em
    table = tl.load(table_ptr + ev, mask=em, other=-1)
    miss = needed & (table < 0)
    n_miss = tl.sum(miss.to(tl.int32), 0)
    last_use = tl.load(last_use_ptr + ev, mask=em, other=0)
    count = tl.load(count_ptr + ev, mask=em, other=0)
    score = tl.load(score_ptr + ev, mask=em, other=0.0)

    owner = tl.load(owner_ptr + sv, mask=sm, other=-1)  # [SP]
    free = owner < 0
    onehot = (owner[:, None] == ev[None, :]) & sm[:, None]  # [SP, EP]
    owner_needed = tl.max((onehot & needed[None, :]).to(tl.int32), 1) > 0
    group = tl.where(free, 0, tl.where(owner_needed, 2, 1))
    k2 = tl.where(free, 0, _gather(onehot, last_use))
    if POLICY == 1:  # lfu: (count, last use)
        k1 = tl.where(free, 0, _gather(onehot, count))
    elif POLICY == 2:  # hot-lru: (hot, last use); hot = top num_hot by score (ties: lower id), > 0
        ahead = (score[None, :] > score[:, None]) | ((score[None, :] == score[:, None])
                                                     & (ev[None, :] < ev[:, None]))
        n_ahead = tl.sum((ahead & em[None, :]).to(tl.int32), 1)
        hot = ((n_ahead < num_hot) & (score > 0)).to(tl.int64)
        k1 = tl.where(free, 0, _gather(onehot, hot))
    else:
        k1 = tl.zeros([SP], tl.int64)
    tie = tl.where(free, sv.to(tl.int64), owner)

    # rank of each slot in the victim order: how many slots come before it
    gr, gc = group[:, None], group[None, :]  # row: the slot ranked, column: the other
    ar, ac = k1[:, None], k1[None, :]
    br, bc = k2[:, None], k2[None, :]
    tr, tc = tie[:, None], tie[None, :]
    before = (gc < gr) | ((gc == gr) & ((ac < ar) | ((ac == ar) & ((bc < br) | ((bc == br) & (tc < tr))))))
    rank = tl.sum((before & sm[None, :]).to(tl.int32), 1)  # [SP]

    miss_rank = tl.cumsum(miss.to(tl.int32), 0) - 1  # [EP], for misses
    takes = (miss_rank[None, :] == rank[:, None]) & miss[None, :] & sm[:, None]  # [SP, EP]: slot <- miss
    matched = (rank < n_miss) & sm
    new_owner = tl.sum(tl.where(takes, ev[None, :], 0), 1)
    tl.store(owner_ptr + sv, tl.where(matched, new_owner, owner), mask=sm)
    evicted = tl.max((onehot & matched[:, None]).to(tl.int32), 0) > 0  # [EP]
    slot_of_miss = tl.sum(tl.where(takes, sv[:, None], 0), 0)
    table = tl.where(miss, slot_of_miss, tl.where(evicted, -1, table))
    tl.store(table_ptr + ev, table, mask=em)
    if FROM_IDS:  # the step's slot ids; a padding row reads slots 0..A-1 (distinct) at weight 0
        sid = tl.sum(tl.where(ids[:, None] == ev[None, :], table[None, :], 0), 1)
        tl.store(sid_ptr + i, tl.where(ok, sid, i % A), mask=i < TA)
        tl.store(w_ptr + i, tl.zeros([TAP], tl.float32), mask=(i < TA) & ~ok)

    # pairs: row j = (the miss of rank j, the slot of rank j), j < n_miss
    jm = (miss_rank[None, :] == sv[:, None]) & miss[None, :]  # [SP, EP]
    pair_e = tl.sum(tl.where(jm, ev[None, :], 0), 1)
    js = rank[None, :] == sv[:, None]  # [SP (j), SP (slot)]
    pair_s = tl.sum(tl.where(js & sm[None, :], sv[None, :], 0), 1)
    valid = sv < n_miss
    tl.store(pairs_ptr + 2 * sv, tl.where(valid, pair_e, -1).to(tl.int64), mask=sm)
    tl.store(pairs_ptr + 2 * sv + 1, tl.where(valid, pair_s, -1).to(tl.int64), mask=sm)

    pending = (tl.load(pending_ptr + ev, mask=em, other=0) != 0) & ~evicted
    if COUNT:
        n_needed = tl.sum(needed.to(tl.int64), 0)
        prefetch_hits = tl.sum((pending & needed).to(tl.int64), 0)
        pending = pending & ~needed
        tl.store(counters_ptr + 0, tl.load(counters_ptr + 0) + n_needed - n_miss)
        tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + n_miss)
        tl.store(counters_ptr + 3, tl.load(counters_ptr + 3) + prefetch_hits)
        clock = tl.load(clock_ptr) + 1
        tl.store(clock_ptr, clock)
        tl.store(last_use_ptr + ev, tl.where(needed, clock, last_use), mask=em)
        tl.store(count_ptr + ev, count + needed.to(tl.int64), mask=em)
        weight = tl.load(weight_ptr) / tl.load(decay_ptr)
        score = tl.where(needed, score + weight, score)
        big = weight > 1e100
        score = tl.where(big, score / weight, score)
        tl.store(score_ptr + ev, score, mask=em)
        tl.store(weight_ptr, tl.where(big, 1.0, weight).to(tl.float64))
    else:
        tl.store(counters_ptr + 2, tl.load(counters_ptr + 2) + n_miss)
        pending = pending | miss
    tl.store(pending_ptr + ev, pending.to(tl.int8), mask=em)


def slot_admit(state, policy: str, num_hot: int, pairs: torch.Tensor, *, ids: torch.Tensor | None = None,
               live: torch.Tensor | None = None, sid: torch.Tensor | None = None, w: torch.Tensor | None = None,
               needed: torch.Tensor | None = None, count: bool = True) -> None:
    """One launch of the admission. state: the DeviceSlotMap (its tensors are updated in
    place); either ids [T, A] with live (a device scalar of live rows), sid [T, A] int32 (out:
    slot ids) and w [T, A] float32 (padding rows zeroed in place), or needed [E] bool."""
    E, S = state.num_experts, state.num_slots
    from_ids = ids is not None
    ta = ids.numel() if from_ids else 1
    a = ids.shape[1] if from_ids else 1
    dummy = state.clock
    _slot_admit_kernel[(1,)](
        ids if from_ids else dummy, ta, a, live if from_ids else dummy,
        dummy if from_ids else needed.view(torch.uint8), sid if from_ids else dummy, w if from_ids else dummy,
        state.table, state.owner, state.last_use, state.count, state.score, state.weight, state.decay,
        state.clock, state.counters, state.pending.view(torch.uint8), pairs, E, S, num_hot,
        POLICY=POLICY_CODES[policy], FROM_IDS=from_ids, COUNT=count,
        EP=triton.next_power_of_2(E), SP=triton.next_power_of_2(S),
        TAP=triton.next_power_of_2(ta), num_warps=8)
