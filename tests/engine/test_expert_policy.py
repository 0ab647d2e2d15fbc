"""Eviction policies, the slot map, routing traces and the simulator, on traces whose
answers are known by hand."""

from __future__ import annotations

import io
import json

import pytest

from lowbit.bench.expert_cache import zipf_trace
from lowbit.cli import main as cli_main
from lowbit.engine.expert_policy import (
    LFU,
    LRU,
    HotLRU,
    RoutingTrace,
    SlotMap,
    load_trace,
    make_policy,
    simulate,
    write_header,
    write_step,
)
from lowbit.errors import LowbitError


def one_layer(seq: list[int], num_experts: int = 3) -> RoutingTrace:
    """Decode steps of one token routed to one expert each, one MoE layer."""
    return RoutingTrace(num_experts, 1, [0], [[[[e]]] for e in seq], [None] * len(seq))


def test_cyclic_trace_known_answers():
    """0 1 2 0 1 2 through 2 slots: LRU always evicts the next expert needed (no hit);
    Belady keeps 0 at step 3 and 2 at step 6: 2 hits of 6."""
    trace = one_layer([0, 1, 2, 0, 1, 2])
    assert (simulate(trace, 2, "lru").hits, simulate(trace, 2, "lru").misses) == (0, 6)
    best = simulate(trace, 2, "belady")
    assert (best.hits, best.misses) == (2, 4)
    assert simulate(trace, 3, "lru").misses == 3  # every expert fits: cold misses only


def test_belady_bounds_every_policy():
    trace = zipf_trace(16, 2, 3, 120, 1.0, seed=1)
    best = simulate(trace, 4, "belady").hit_rate
    for policy in ("lru", "lfu", "hot-lru"):
        r = simulate(trace, 4, policy)
        assert 0 < r.hit_rate <= best
        assert len(r.per_layer) == 3


def test_a0_evicts_the_least_used_expert_of_the_whole_trace():
    """A0 knows each expert's count over the trace in advance: 0 0 0 1 2 1 2 through 2
    slots keeps expert 0 (used most) and churns the other slot, where LRU evicts 0 at step 5;
    on an independent draw (Zipf) it beats the online policies and stays under Belady."""
    trace = one_layer([0, 0, 0, 1, 2, 0, 1, 2, 0])
    a0, lru = simulate(trace, 2, "a0"), simulate(trace, 2, "lru")
    assert (a0.hits, a0.misses) == (4, 5)  # hits: 0 0 at steps 2-3, then 0 at steps 6 and 9
    assert (lru.hits, lru.misses) == (2, 7)
    trace = zipf_trace(32, 4, 4, 600, 1.0, seed=3)
    best, a0 = simulate(trace, 8, "belady").hit_rate, simulate(trace, 8, "a0").hit_rate
    assert a0 < best
    for policy in ("lru", "lfu", "hot-lru"):
        assert simulate(trace, 8, policy).hit_rate < a0, policy


def test_lfu_and_hot_lru_keep_the_frequent_expert():
    """Expert 0 is used often, then 1 and 2 once each; a third expert must evict one."""
    for cls in (LFU, HotLRU):
        pol = cls(2, 8)  # hot-lru: 1 hot expert
        for _ in range(5):
            pol.touch([0])
        pol.touch([1])
        pol.touch([2])
        assert pol.victim([0, 1, 2]) == 1, cls.__name__
    lru = LRU(4, 8)
    for e in (0, 0, 1, 2):
        lru.touch([e])
    assert lru.victim([0, 1, 2]) == 0


def test_hot_lru_pins_only_its_share():
    pol = HotLRU(4, 8)  # 3 hot experts at HOT_SHARE 0.75
    for e in (0, 1, 2, 3, 0, 1, 2):
        pol.touch([e])
    assert pol.hot() == {0, 1, 2}
    assert pol.victim([0, 1, 2, 3]) == 3  # the recent but cold one
    assert pol.victim([0, 1, 2]) == 0  # all hot: least recently used of them


def test_slot_map_fills_free_slots_then_evicts():
    m = SlotMap(2, make_policy("lru", 2, 4))
    assert m.admit([3, 1]) == [(1, 0), (3, 1)]
    assert m.admit([1]) == []
    assert m.admit([2, 1]) == [(2, 1)]  # 3 was least recently used
    assert (m.hits, m.misses) == (2, 3)
    with pytest.raises(ValueError, match="3 experts needed at once, 2 slots"):
        m.admit([0, 1, 2])
    with pytest.raises(LowbitError, match="unknown expert cache policy"):
        make_policy("fifo", 2, 4)


def test_prefill_steps_run_in_groups():
    """A step needing 4 experts through 2 slots is two groups, {0, 1} then {2, 3}: 4 misses;
    the second group stays resident for a next step that needs only it (2 hits)."""
    trace = RoutingTrace(4, 2, [0], [[[[0, 1], [2, 3]]], [[[3, 2]]]], [None, None])
    r = simulate(trace, 2, "lru")
    assert (r.hits, r.misses) == (2, 4)


def test_prefetch_turns_predicted_misses_into_hits():
    steps = [[[[0]], [[e]]] for e in (1, 2, 3, 1, 2, 3)]
    trace = RoutingTrace(4, 1, [0, 1], steps, [[[e], []] for e in (1, 2, 3, 1, 2, 3)])
    plain, pre = simulate(trace, 2, "lru"), simulate(trace, 2, "lru", prefetch=True)
    assert plain.per_layer[1] == 0.0 and pre.per_layer[1] == 1.0
    assert pre.prefetch_hits == 6 and pre.prefetched == 6


def test_trace_round_trip(tmp_path):
    f = io.StringIO()
    write_header(f, 8, 2, [1, 3])
    write_step(f, 0, [[[1, 2], [3, 4]], [[5, 6], [7, 0]]], [[5, 6], []])
    write_step(f, 1, [[[1, 2]], [[5, 7]]], None)
    path = tmp_path / "t.jsonl"
    path.write_text(f.getvalue())
    t = load_trace(path)
    assert (t.num_experts, t.top_k, t.moe_layers) == (8, 2, [1, 3])
    assert t.steps[0][1] == [[5, 6], [7, 0]] and t.needed(0, 1) == [0, 5, 6, 7]
    assert t.preds == [[[5, 6], []], None]
    path.write_text('{"num_experts": 8}\n')
    with pytest.raises(LowbitError, match="not a routing trace"):
        load_trace(path)


def test_zipf_trace_is_skewed_and_seeded():
    a, b = zipf_trace(32, 4, 2, 200, 1.0), zipf_trace(32, 4, 2, 200, 1.0)
    assert a.steps == b.steps
    assert all(len(set(tok)) == 4 for step in a.steps for layer in step for tok in layer)
    counts = [0] * 32
    for step in a.steps:
        for e in step[0][0]:
            counts[e] += 1
    assert max(counts) > 4 * sorted(counts)[16]  # the head is far above the median


def test_bench_expert_cache_cli(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    with path.open("w") as f:
        write_header(f, 3, 1, [0])
        for i, e in enumerate([0, 1, 2, 0, 1, 2]):
            write_step(f, i, [[[e]]], None)
    assert cli_main(["bench", "expert-cache", "--trace", str(path), "--slots", "2", "--policy", "lru,belady",
                     "--json"]) == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["lru"]["hit_rate"] == 0.0 and rows["belady"]["hit_rate"] == pytest.approx(1 / 3, abs=1e-4)
    # every expert is used as often: A0 falls back to least recently used and hits nothing
    assert "of_a0" in rows["lru"] and rows["lru"]["of_a0"] is None
    assert cli_main(["bench", "expert-cache", "--trace", str(path), "--policy", "mru"]) == 2
    assert "unknown policy 'mru'" in capsys.readouterr().err
    assert cli_main(["bench", "expert-cache", "--trace", str(path), "--slots", "0"]) == 2
