"""Expert offload on CUDA: pinned host experts, side-stream copies, the decode graph's hit
path. Greedy tokens equal the resident engine's (graphs on, bf16); admits, and a step whose
experts are all resident (a graph replay), run with no implicit host sync (sync debug mode
"error").

When greedy equality fails, the other tests say where: the layer through groups of slots
against the resident layer (the fused kernels' roundings), then graphs on against graphs off
at the same slot count (the replay, its miss check and the eager rerun), step by step."""

from __future__ import annotations

import pytest
import torch

from lowbit.config import EngineConfig
from lowbit.engine.engine import LLMEngine
from lowbit.engine.expert_cache import ExpertCache
from lowbit.engine.sampling import SamplingParams
from lowbit.kernels.runtime import interpreting
from lowbit.layers.moe import RouterSpec, SparseMoE
from tests.engine.helpers import run_all, tokens_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET=1 is set: GPU tests run compiled kernels"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 9, [7, 9]]


def _engine(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model="demo", device="cuda", dtype="bfloat16", kv_cache_tokens=4096,
                                  max_num_seqs=8, **kw))


def _tokens(engine: LLMEngine, prompts, sp: SamplingParams = GREEDY) -> list[list[int]]:
    reqs = [engine.add_request(p, sp) for p in prompts]
    out = run_all(engine)
    return [tokens_of(out[r.request_id]) for r in reqs]


@pytest.mark.parametrize("slots", [8, 3, 2])
@pytest.mark.parametrize("batch", [1, 4])
def test_offload_greedy_equals_resident(slots, batch):
    """The offload engine's prefill runs eagerly (the cache reads the routing on the host), so
    the twin is the resident engine with eager prefill: a prefill graph pads a 4-token prompt
    to its 64-token bucket, which takes the grouped MoE tiles where 4 tokens take the
    per-slot gemv, and greedy tokens of the random demo model part after a few steps."""
    want = _tokens(_engine(prefill_graphs=False), PROMPTS[:batch])
    engine = _engine(expert_offload=True, expert_cache_slots=slots)
    assert _tokens(engine, PROMPTS[:batch]) == want
    cache = engine.expert_cache
    t = cache.totals()
    assert t["misses"] > 0 and t["bytes_copied"] > 0
    assert cache.layers[0].host["w13.w"].is_pinned()
    assert t["graph_steps"] + t["graph_reruns"] > 0  # decode steps went through the graph


@pytest.mark.parametrize("slots", [4, 6])
def test_graph_form_prefetch_equals_resident_and_prefetches_in_the_graph(slots):
    """--expert-prefetch-graphs on real graphs: the next layer's experts copied on the side
    stream inside the replay, joined before that layer admits; one sequence, the resident
    tokens, every decode step replayed, prefetched experts used."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _tokens(_engine(prefill_graphs=False), PROMPTS[:1], sp)
    engine = _engine(expert_offload=True, expert_cache_slots=slots, expert_prefetch_graphs=True)
    assert _tokens(engine, PROMPTS[:1], sp) == want
    t = engine.expert_cache.totals()
    assert t["graph_reruns"] == 0 and t["graph_steps"] >= sp.max_tokens - 1
    assert t["prefetched"] > 0 and t["prefetch_hits"] > 0


def test_long_offload_generation_equals_resident_through_reruns():
    """2 slots: most decode steps miss and rerun. A rerun runs with the graph's shapes (the
    bucket of 4 for 3 sequences, the full table width), so its attention splits as the
    replays do and 120 tokens (contexts past 128) stay the resident engine's."""
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    want = _tokens(_engine(), PROMPTS[:3], sp)
    engine = _engine(expert_offload=True, expert_cache_slots=2)
    assert _tokens(engine, PROMPTS[:3], sp) == want
    assert engine.expert_cache.totals()["graph_reruns"] > sp.max_tokens // 2


def _layer() -> SparseMoE:
    """A random bf16 MoE layer on the GPU: 8 experts of width 192 over 256, top-2."""
    torch.manual_seed(0)
    moe = SparseMoE(256, 8, 192, RouterSpec(top_k=2), "layer0")
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.05)
    return moe.to("cuda", torch.bfloat16)


def _offload(moe: SparseMoE, slots: int) -> ExpertCache:
    cache = ExpertCache(torch.nn.ModuleList([moe]), torch.device("cuda"), offload=True, prefetch=False)
    cache.allocate(slots, "lru")
    return cache


@pytest.mark.parametrize("tokens", [4, 12, 40])  # per-slot gemv, decode tiles, grouped tiles
def test_grouped_experts_round_once_like_the_resident_layer(tokens):
    """2 slots of 8 experts (top-2): the tokens' experts run in groups, each written in
    float32 and summed, rounded to bf16 once; bitwise the resident op's output."""
    moe = _layer()
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        want = moe(x)
        cache = _offload(moe, 2)
        got = moe(x)
    assert cache.layers[0].stats.misses > 2  # groups ran
    assert torch.equal(got, want), int((got != want).sum())


def test_admits_queue_without_a_host_sync():
    """Admits, evictions included, queue their copies and slot-table writes on the side
    stream and return: a prefetch overlaps the layer that queued it."""
    layer = _offload(_layer(), 2).layers[0]
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer.admit([0, 1])
        layer.admit([5, 6])  # evicts both
    finally:
        torch.cuda.set_sync_debug_mode(0)
    layer.wait_copies()
    table = layer.slot_table.tolist()
    assert sorted(table[5:7]) == [0, 1] and table.count(-1) == 6
    for e in (5, 6):
        assert torch.equal(layer.slots["w13.w"][table[e]].cpu(), layer.host["w13.w"][e])


def _steps(engine: LLMEngine, prompts) -> tuple[list[list[int]], list[dict]]:
    """Greedy tokens, and each step's change of the cache's counters."""
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    cache, steps = engine.expert_cache, []
    while engine.has_unfinished():
        before = cache.totals()
        engine.step()
        after = cache.totals()
        steps.append({k: after[k] - before[k] for k in ("hits", "misses", "graph_steps", "graph_reruns")})
    return [r.output_token_ids for r in reqs], steps


@pytest.mark.parametrize("batch,slots", [(1, 2), (1, 4), (4, 2), (4, 4)])
def test_graph_replays_and_reruns_equal_eager_steps(batch, slots):
    """No prefetch: the slots evolve the same with graphs on and off, so each step has the
    same hits and misses. A bucket whose experts fit the slots (1 row x top-2 <= slots)
    copies its misses inside the replay, which always stands; in a larger one a decode
    step's replay stands exactly when its eager twin hit in every layer, and is rerun
    eagerly exactly when it missed."""
    kw = dict(expert_offload=True, expert_cache_slots=slots, expert_prefetch=False,
              async_scheduling=False)  # step for step: each step read at once
    eager_tokens, eager = _steps(_engine(enforce_eager=True, **kw), PROMPTS[:batch])
    engine = _engine(**kw)
    graph_tokens, graph = _steps(engine, PROMPTS[:batch])
    resolved = engine.expert_cache.layers[0].resolves(batch)
    assert resolved == (batch == 1)
    assert len(graph) == len(eager)
    for i, (g, e) in enumerate(zip(graph, eager)):
        assert (g["hits"], g["misses"]) == (e["hits"], e["misses"]), (i, g, e)
        want = (0, 0) if i == 0 else ((0, 1) if e["misses"] and not resolved else (1, 0))  # 0: the prefill
        assert (g["graph_steps"], g["graph_reruns"]) == want, (i, g, e)
    assert sum(e["misses"] for e in eager[1:]) > 0
    assert graph_tokens == eager_tokens


def test_the_copy_kernel_reads_pinned_host_memory():
    """Zero-copy: the kernel reads the pinned host stacks through unified addressing."""
    from lowbit.kernels.expert_copy import copy_experts

    src = {"codes": torch.randint(0, 255, (6, 3000), dtype=torch.uint8).pin_memory(),
           "scales": torch.randn(6, 7, 5).pin_memory()}
    dst = {k: torch.zeros(4, *t.shape[1:], dtype=t.dtype, device="cuda") for k, t in src.items()}
    pairs = torch.tensor([[5, 1], [-1, -1], [2, 3]], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        copy_experts(pairs, src, dst)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for k in src:
        assert torch.equal(dst[k][1].cpu(), src[k][5]) and torch.equal(dst[k][3].cpu(), src[k][2])
        assert not dst[k][0].any() and not dst[k][2].any()


def test_resolved_misses_replay_without_a_host_sync():
    """2 slots, top-2, one sequence: every decode step's misses are admitted and copied in
    the graph; steps run under sync debug mode "error", the replays stand, misses happen,
    and the tokens are the resident engine's."""
    want = _tokens(_engine(prefill_graphs=False), PROMPTS[:1])
    engine = _engine(expert_offload=True, expert_cache_slots=2, expert_prefetch=False)
    _tokens(engine, PROMPTS[1:2])  # the bucket's graph captured
    req = engine.add_request(PROMPTS[0], GREEDY)
    deltas = list(engine.step())  # prefill, eager
    cache = engine.expert_cache
    before = cache.totals()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_unfinished():
            deltas += engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    after = cache.totals()
    assert after["graph_reruns"] == before["graph_reruns"] and after["graph_steps"] > before["graph_steps"]
    assert after["misses"] > before["misses"]
    assert tokens_of([d for d in deltas if d.request_id == req.request_id]) == want[0]


def test_resident_steps_replay_without_a_host_sync():
    engine = _engine(expert_offload=True, expert_cache_slots=8)
    _tokens(engine, PROMPTS)  # the bucket's graph captured
    for layer in engine.expert_cache.layers:
        layer.admit(list(range(layer.num_experts)))  # every expert resident
    for p in PROMPTS:
        engine.add_request(p, GREEDY)
    engine.step()  # prefill, eager
    cache = engine.expert_cache
    steps, reruns = cache.graph_steps, cache.graph_reruns  # the first run's reruns were misses
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert (cache.graph_steps, cache.graph_reruns) == (steps + 5, reruns)


@pytest.mark.parametrize("policy", ["lru", "lfu", "hot-lru"])
def test_the_admission_kernel_is_its_torch_twin_on_cuda(policy):
    """The one-launch admission (compiled) against the torch ops of DeviceSlotMap, at the
    Qwen3-30B-A3B routing shape: same pairs and state after every step."""
    import random

    from lowbit.engine.slot_map import DeviceSlotMap

    rng, E, S, A = random.Random(0), 128, 32, 8
    twin, kern = (DeviceSlotMap(S, E, policy, torch.device("cuda")) for _ in range(2))
    twin.use_kernel = False
    hot = rng.sample(range(E), 32)
    for step in range(60):
        rows = [rng.sample(hot if rng.random() < 0.7 else range(E), A) for _ in range(4)]
        ids = torch.tensor(rows, dtype=torch.int32, device="cuda")
        live = torch.tensor(rng.randint(1, 4), device="cuda")
        w = torch.rand(4, A, device="cuda")
        for a, b in zip(twin.admit_routed(ids, w, live), kern.admit_routed(ids, w, live)):
            assert torch.equal(a, b), step
        for k in DeviceSlotMap.STATE:
            assert torch.equal(getattr(twin, k), getattr(kern, k)), (step, k)


def _nvfp4_layer(seed: int) -> SparseMoE:
    """A random nvfp4 MoE layer at the Qwen3-30B-A3B expert shape: 128 experts of width 768
    over 2048, top-8, on the GPU in bf16."""
    from lowbit.formats import FORMATS

    torch.manual_seed(seed)
    moe = SparseMoE(2048, 128, 768, RouterSpec(top_k=8), f"layer{seed}").to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
        for name in ("w13", "w2"):
            moe.experts.set_quantized_weight(name, FORMATS["nvfp4"].quantize(getattr(moe.experts, name).data))
    return moe


def test_nvfp4_layers_at_the_30b_shape_through_fetch_and_resolve():
    """Two nvfp4 layers at the Qwen3-30B-A3B expert shape with 32 slots (hot-lru, prefetch
    on), what `lowbit bench latency --expert-offload --expert-cache-slots 32` runs: a
    64-token prefill in groups, single tokens through the fetch path (pre-gating layer 1),
    then single tokens replayed from a captured graph in the resolve form (the warm-up under
    sync debug mode "error"); every output is the resident layers'."""
    layers = torch.nn.ModuleList([_nvfp4_layer(0), _nvfp4_layer(1)])
    torch.manual_seed(2)
    prefill = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    singles = [torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(16)]
    with torch.inference_mode():
        want = [[m(x) for m in layers] for x in [prefill, *singles]]
        cache = ExpertCache(layers, torch.device("cuda"), offload=True, prefetch=True)
        cache.allocate(32, "hot-lru")
        assert cache.resolve_rows == 4
        got = [[m(x) for m in layers] for x in [prefill, *singles[:8]]]
        torch.cuda.synchronize()
        for i, (g, w) in enumerate(zip(got, want)):
            for a, b in zip(g, w):
                torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3, msg=lambda m, i=i: f"input {i}: {m}")
        static = singles[8].clone()
        cache.num_live = 1
        cache.live_rows.fill_(1)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            warm = [m(static) for m in layers]  # the warm-up step: admissions put back
        finally:
            torch.cuda.set_sync_debug_mode(0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = [m(static) for m in layers]
        misses = cache.totals()["misses"]
        replayed = []
        for x in singles[8:]:
            static.copy_(x)
            graph.replay()
            replayed.append([o.clone() for o in out])
        torch.cuda.synchronize()
    for a, b in zip(warm, want[9]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    for i, (g, w) in enumerate(zip(replayed, want[9:])):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3, msg=lambda m, i=i: f"replay {i}: {m}")
    assert cache.totals()["misses"] > misses  # the replays admitted and copied misses
    for layer in cache.layers:  # the map is true to the slots' contents
        for s, e in enumerate(layer.owner):
            if e >= 0:
                assert torch.equal(layer.slots["w13.codes"][s].cpu(), layer.host["w13.codes"][e]), (s, e)


def test_side_stream_copies_read_their_own_pairs():
    """The copies of an admit run on the side stream after the compute stream has moved on;
    the pairs they read must not be handed to the compute stream's next allocations. The
    side stream is held back (a sleep queued on it), the compute stream then allocates and
    fills blocks of the pairs' size, and the copies must still land where the map says."""
    layer = _offload(_layer(), 2).layers[0]
    torch.cuda.synchronize()
    with torch.cuda.stream(layer.stream):
        torch.cuda._sleep(50_000_000)  # ~25 ms at 2 GHz: the copies queue behind it
    layer.admit([3, 6])
    junk = [torch.full((layer.num_slots, 2), 7 << 40, dtype=torch.int64, device="cuda") for _ in range(64)]
    layer.wait_copies()
    torch.cuda.synchronize()
    del junk
    table = layer.slot_table.tolist()
    for e in (3, 6):
        assert table[e] >= 0
        assert torch.equal(layer.slots["w13.w"][table[e]].cpu(), layer.host["w13.w"][e]), e
