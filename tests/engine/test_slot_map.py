"""The device slot map (lowbit/engine/slot_map.py) admits as the host SlotMap and its
policies do (lowbit/engine/expert_policy.py), copy for copy, on random routing traces."""

import random

import pytest
import torch

from lowbit.engine.expert_policy import POLICIES, SlotMap, make_policy
from lowbit.engine.slot_map import HITS, MISSES, PREFETCH_HITS, PREFETCHED, DeviceSlotMap
from lowbit.kernels.runtime import interpreting


def skewed_step(rng: random.Random, E: int, tokens: int, top_k: int, hot: list[int]) -> list[int]:
    """The experts a step's tokens were routed to: mostly from a hot set, sometimes anywhere."""
    needed: set[int] = set()
    for _ in range(tokens):
        pool = hot if rng.random() < 0.7 else list(range(E))
        needed |= set(rng.sample(pool, min(top_k, len(pool))))
    return sorted(needed)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("E,S,tokens,top_k", [(8, 2, 1, 2), (8, 3, 1, 2), (16, 5, 2, 2), (32, 12, 1, 8),
                                              (64, 17, 2, 8), (9, 9, 3, 3), (8, 1, 1, 1)])
def test_device_admission_makes_the_host_maps_copies(policy, E, S, tokens, top_k):
    rng = random.Random(E * 1000 + S * 10 + tokens)
    host = SlotMap(S, make_policy(policy, S, E))
    dev = DeviceSlotMap(S, E, policy, torch.device("cpu"))
    hot = rng.sample(range(E), max(top_k, E // 4))
    steps = 0
    for step in range(300):
        needed = skewed_step(rng, E, tokens, top_k, hot)
        if len(needed) > S:
            needed = needed[:S]
        prefetch = step % 7 == 3  # uncounted admissions, as pre-gating makes them
        want = host.admit(needed, count=not prefetch)
        mask = torch.zeros(E, dtype=torch.bool)
        mask[needed] = True
        got = dev.admit(mask, count=not prefetch)
        rows = [(e, s) for e, s in got.tolist() if e >= 0]
        assert rows == want, f"step {step}"
        assert all(s == -1 for e, s in got.tolist() if e < 0)
        table = [host.slot_of.get(e, -1) for e in range(E)]
        assert dev.slot_table.tolist() == table
        assert dev.owners() == [next((e for e, t in host.slot_of.items() if t == s), -1) for s in range(S)]
        steps += not prefetch
        if step % 50 == 49:  # the used experts of a step that only counted them (graph_check's touch)
            used = sorted(host.slot_of)[:max(1, S // 2)]
            host.policy.touch(used)
            u = torch.zeros(E, dtype=torch.bool)
            u[used] = True
            dev.touch(u)
    assert dev.counters[HITS] == host.hits and dev.counters[MISSES] == host.misses
    assert host.misses > 0 and (host.hits > 0 or S == 1)


def test_prefetch_counters_and_pending_experts():
    dev = DeviceSlotMap(4, 8, "lru", torch.device("cpu"))
    m = lambda *e: torch.zeros(8, dtype=torch.bool).index_fill_(0, torch.tensor(e), True)  # noqa: E731
    dev.admit(m(1, 2))
    dev.admit(m(3, 5), count=False)  # two prefetched
    dev.admit(m(1, 3))  # a hit on a prefetched expert
    assert dev.stats() == {"hits": 2, "misses": 2, "prefetched": 2, "prefetch_hits": 1}
    dev.admit(m(6, 7))  # evicts 2 and 5 (least recently used; 5 was never used)
    assert sorted(dev.owners()) == [1, 3, 6, 7]
    assert not dev.pending[5] and int(dev.counters[PREFETCHED]) == 2 and int(dev.counters[PREFETCH_HITS]) == 1


def test_needed_mask_ignores_padding_rows_and_bad_ids():
    dev = DeviceSlotMap(4, 8, "hot-lru", torch.device("cpu"))
    ids = torch.tensor([[1, 4], [7, -1], [2, 3]], dtype=torch.int32)
    live = torch.tensor([[True], [True], [False]])
    assert dev.needed_mask(ids, live).nonzero().flatten().tolist() == [1, 4, 7]
    assert dev.needed_mask(ids).nonzero().flatten().tolist() == [1, 2, 3, 4, 7]


def _state(m: DeviceSlotMap) -> list:
    return [getattr(m, k).clone() for k in m.STATE]


@pytest.mark.skipif(not interpreting(), reason="runs the Triton admission in the interpreter")
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("E,S,T,A", [(8, 3, 1, 2), (20, 7, 3, 2), (64, 16, 2, 8), (128, 32, 4, 8)])
def test_the_admission_kernel_is_the_torch_twin_bit_for_bit(policy, E, S, T, A):
    """slot_admit (one Triton program) against DeviceSlotMap's torch ops: the same pairs and
    every state tensor equal after each step (float64 scores included), from routed ids
    with padding rows and from prefetch masks."""
    rng = random.Random(E + S)
    twin, kern = (DeviceSlotMap(S, E, policy, torch.device("cpu")) for _ in range(2))
    kern.use_kernel = True
    hot = rng.sample(range(E), max(A, E // 4))
    for step in range(40):
        if step % 5 == 4:  # a prefetch: an uncounted mask
            m = torch.zeros(E, dtype=torch.bool)
            m[rng.sample(range(E), max(1, S // 2))] = True
            want, got = twin.admit(m, count=False), kern.admit(m, count=False)
        else:
            rows = [rng.sample(hot if rng.random() < 0.7 else range(E), A) for _ in range(T)]
            live = rng.randint(1, T)
            while len({e for r in rows[:live] for e in r}) > S:
                live -= 1
            ids, w = torch.tensor(rows, dtype=torch.int32), torch.rand(T, A)
            want = twin.admit_routed(ids, w, torch.tensor(live))
            got = kern.admit_routed(ids, w, torch.tensor(live))
            assert torch.equal(want[1], got[1]) and torch.equal(want[2], got[2]), step  # slot ids, weights
            assert (got[1][:live] >= 0).all() and (got[2][live:] == 0).all()
            assert all(len(set(r)) == A for r in got[1].tolist())  # distinct slots in every row
            want, got = want[0], got[0]
        assert torch.equal(want, got), step
        for k, a, b in zip(DeviceSlotMap.STATE, _state(twin), _state(kern)):
            assert torch.equal(a, b), (step, k)
    assert int(twin.counters[MISSES]) > 0 and int(twin.counters[HITS]) > 0


def test_device_state_is_never_written_from_a_host_scalar():
    """`state[i] = 3` on a CUDA tensor copies a host scalar to the device: a synchronizing
    copy that breaks the capture of a step that admits its own misses (free() runs in the
    warm-up step before every capture). The map's device-side code writes scalars with
    fill_ / index_fill_ instead; this reads its source for the pattern."""
    import ast
    import inspect

    from lowbit.engine import expert_cache, slot_map

    bad = []
    for mod in (slot_map, expert_cache):
        for node in ast.walk(ast.parse(inspect.getsource(mod))):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AugAssign) else [])
            for t in targets:
                v = getattr(node, "value", None)
                v = v.operand if isinstance(v, ast.UnaryOp) else v
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and isinstance(v, ast.Constant):
                    bad.append(f"{mod.__name__}:{node.lineno}")
    assert not bad, bad
