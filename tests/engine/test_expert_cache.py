"""Expert offload: greedy outputs through a few device slots equal the resident model's;
the graph path's miss detection; sizing; flags; telemetry; the routing recorder."""

from __future__ import annotations

import pytest
import torch

from lowbit import LLM, SamplingParams
from lowbit.checkpoint.loader import DeviceFiller
from lowbit.cli import main as cli_main
from lowbit.config import EngineConfig
from lowbit.engine.cuda_graphs import DecodeGraphs
from lowbit.engine.engine import LLMEngine
from lowbit.engine.expert_cache import ExpertCache, distinct_slots, plan_slots
from lowbit.engine.expert_policy import load_trace, simulate
from lowbit.errors import LowbitError
from lowbit.formats import FORMATS
from lowbit.kernels import routes
from lowbit.kernels.attention import reference_paged_attention
from lowbit.kernels.runtime import interpreting
from lowbit.layers.moe import RouterSpec, SparseMoE
from lowbit.server.metrics import render

PROMPTS = ["Once upon a time", "The river town"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def demo_resident() -> dict:
    """Greedy tokens of the resident demo model, per weight format."""
    return {fmt: _tokens(LLM("demo", device="cpu", kv_cache_tokens=256, quantization=fmt))
            for fmt in (None, "int4")}


@pytest.mark.parametrize("slots,fmt", [(3, None), (2, None), (1, None), (3, "int4")])
def test_demo_greedy_equal_with_offload(demo_resident, slots, fmt):
    """The demo model has 8 experts (top-2) per layer: 3, 2 and 1 slots force misses and
    evictions (two sequences decode together: up to 4 experts a step, run in groups)."""
    llm = LLM("demo", device="cpu", kv_cache_tokens=256, quantization=fmt, expert_offload=True,
              expert_cache_slots=slots)
    assert _tokens(llm) == demo_resident[fmt]
    cache = llm.engine.expert_cache
    t, first = cache.totals(), cache.layers[0]
    assert first.num_slots == slots
    assert t["misses"] > 0 and t["hits"] > 0
    assert t["bytes_copied"] > len(cache.layers) * 8 * first.expert_bytes  # more copies than experts: evictions
    assert all(s.shape[0] == max(slots, 2) for s in first.slots.values())  # at least top-k physical
    assert not any(p.is_cuda for p in llm.model.parameters())


def test_tiny_qwen3_moe_equal_with_offload(tiny_model, make_engine):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [[72, 101, 108, 108, 111], [87, 111, 114]]
    resident = LLM(str(tiny_model), kv_cache_tokens=512, loaded=make_engine().loaded)
    want = [o.outputs[0].token_ids for o in resident.generate(ids, sp)]
    offload = LLM(str(tiny_model), kv_cache_tokens=512, expert_offload=True, expert_cache_slots=2,
                  expert_cache_policy="lru")
    assert [o.outputs[0].token_ids for o in offload.generate(ids, sp)] == want
    assert offload.engine.expert_cache.totals()["misses"] > 4  # the tiny model has 4 experts


def _needs_interpreter() -> None:
    """Forced Triton routes on the CPU run under TRITON_INTERPRET=1, which the kernel tests'
    conftest sets for a whole run (read when the test runs, not when it is collected)."""
    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/kernels/conftest.py)")


def _moe(fmt: str | None, bias: bool, seed: int) -> SparseMoE:
    """Six experts of width 32 over a hidden size of 32, random, optionally quantized."""
    torch.manual_seed(seed)
    act = dict(activation="swiglu_oai", limit=7.0) if bias else {}
    moe = SparseMoE(32, 6, 32, RouterSpec(top_k=2), f"layer{seed}", expert_bias=bias, **act)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    if fmt is not None:
        for name in ("w13", "w2"):
            moe.experts.set_quantized_weight(name, FORMATS[fmt].quantize(getattr(moe.experts, name).data))
    return moe


@pytest.mark.parametrize("fmt,bias", [(None, True), ("nvfp4", False), ("lut4", False), ("fp8", False)])
def test_slot_stacks_compute_what_the_resident_stacks_do(fmt, bias):
    """Per-expert tables (nvfp4: one per expert; lut4: row groups), fp8 scales, expert biases
    with gpt-oss's activation: two slots of six experts, five tokens (groups of two), and a
    second layer fed by pre-gating."""
    layers = torch.nn.ModuleList([_moe(fmt, bias, 0), _moe(fmt, bias, 1)])
    x = torch.randn(5, 32)
    inputs = [x] + [x[i:i + 1] for i in range(5)]  # then one token at a time: prefetch runs
    with torch.inference_mode():
        want = [m(h) for h in inputs for m in layers]
        cache = ExpertCache(layers, torch.device("cpu"), offload=True)
        cache.allocate(2, "lru")
        got = [m(h) for h in inputs for m in layers]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    t = cache.totals()
    assert t["misses"] > 6 and t["prefetched"] > 0  # groups evict; layer 0 prefetched for layer 1
    assert all(s.shape[0] == 2 for s in cache.layers[0].slots.values())


@pytest.mark.parametrize("slots,bias", [(1, False), (2, False), (3, True)])
def test_groups_round_once_like_the_resident_layer(slots, bias):
    """bf16, bitwise: more experts than slots run in groups. The resident op rounds each
    token's float32 sum of its experts once, so the groups add in float32 (rounded one by
    one, about a third of the outputs were an ulp off and greedy text drifted); and a
    group's masked entries (weight 0) must not change an expert's matmul rows, whose
    results a CPU matmul varies with the row count."""
    moe = _moe(None, bias, 0).to(torch.bfloat16)
    x = torch.randn(40, 32).bfloat16()
    with torch.inference_mode():
        want = moe(x)
        cache = ExpertCache(torch.nn.ModuleList([moe]), torch.device("cpu"), offload=True, prefetch=False)
        cache.allocate(slots, "lru")
        got = moe(x)
    assert cache.layers[0].stats.misses > slots  # groups ran
    assert torch.equal(got, want)


BF16_PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 9, [7, 9]]


def _bf16_tokens(**kw) -> list[list[int]]:
    llm = LLM("demo", device="cpu", dtype="bfloat16", kv_cache_tokens=256, **kw)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(BF16_PROMPTS, sp)]


def test_demo_bf16_greedy_equal_with_offload():
    """The GPU test's prompts and dtype on the CPU: four sequences decode together, so decode
    steps need more experts than 2 or 3 slots and run in groups, like every prefill."""
    want = _bf16_tokens()
    for slots in (3, 2):
        assert _bf16_tokens(expert_offload=True, expert_cache_slots=slots) == want, slots


def test_tensors_a_graph_reads_keep_their_storage():
    """A captured graph keeps the addresses it read at capture: the slot table, slot stacks,
    counters and live-row scalar must be updated in place by admits, evictions, groups,
    graph_check and reset_stats, never replaced."""
    llm = LLM("demo", device="cpu", kv_cache_tokens=64, expert_offload=True, expert_cache_slots=2)
    cache = llm.engine.expert_cache

    def addresses() -> list[int]:
        out = [cache.counters.data_ptr(), cache.live_rows.data_ptr()]
        for c in cache.layers:
            out += [c.slot_table.data_ptr(), c.misses_dev.data_ptr(), c.uses_dev.data_ptr(),
                    c.live_rows.data_ptr()]
            out += [t.data_ptr() for t in c.slots.values()]
            out += [c.views[n].w.data_ptr() for n in ("w13", "w2")]
        return out

    before = addresses()
    llm.generate(PROMPTS, GREEDY)  # prefill groups, decode misses and evictions
    with torch.inference_mode():
        for c in cache.layers:
            c.admit([7, 6])
            c.admit([0, 1])
        cache.force_speculate = True
        cache.moes[0](torch.randn(3, llm.config.hidden_size))
        cache.force_speculate = False
        cache.graph_check()
    cache.reset_stats()
    assert cache.totals()["misses"] == 0 and addresses() == before
    for c in cache.layers:  # the table agrees with the slots' owners after the evictions
        assert sorted(c.owner) == [0, 1] and c.views["w13"].w is c.slots["w13.w"]
        assert c.slot_table.tolist() == [c.owner.index(e) if e in c.owner else -1 for e in range(8)]


def test_offloaded_layers_launch_with_the_models_tuned_configs(monkeypatch):
    """Launch configs are keyed by the stack's expert count: a slot stack must look up the
    model's (E = 6 here, not 2 slots), or a tuned shape falls back to the defaults and
    rounds differently from the resident model."""
    from lowbit.kernels import launch

    _needs_interpreter()
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "triton_fused_moe_decode")
    seen = []
    lookup = launch.lookup
    monkeypatch.setattr(launch, "lookup", lambda kernel, fmt, n, k, m, device=None:
                        seen.append((kernel, n)) or lookup(kernel, fmt, n, k, m, device))
    layers = torch.nn.ModuleList([_moe("nvfp4", False, 0)])
    x = torch.randn(3, 32)
    with torch.inference_mode():
        want = layers[0](x)
        cache = ExpertCache(layers, torch.device("cpu"), offload=True, prefetch=False)
        cache.allocate(2, "lru")
        got = layers[0](x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    moe_calls = [n for kernel, n in seen if kernel.startswith("moe_")]
    assert moe_calls and set(moe_calls) == {6}, seen


@pytest.mark.parametrize("tokens", [1, 16])
def test_slot_stacks_through_the_fused_decode_kernel(monkeypatch, tokens):
    """The Triton decode route (interpreted) reads nvfp4 slot stacks as it reads the resident
    stack: one token takes the per-slot gemv on both sides, 16 tokens the expert tiles (whose
    invariant, at most one slot per expert and token, the masked entries must keep)."""
    _needs_interpreter()
    monkeypatch.setenv("LOWBIT_ROUTE_MOE", "triton_fused_moe_decode")
    layers = torch.nn.ModuleList([_moe("nvfp4", False, 0)])
    x = torch.randn(tokens, 32)
    with torch.inference_mode():
        want = layers[0](x)
        cache = ExpertCache(layers, torch.device("cpu"), offload=True, prefetch=False)
        cache.allocate(2 if tokens > 1 else 4, "lru")
        got = layers[0](x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_distinct_slots_keeps_each_row_free_of_repeats():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        S, A, T = 5, 3, 7
        sid = torch.stack([torch.randperm(S, generator=g)[:A] for _ in range(T)]).int()
        real = torch.rand(T, A, generator=g) < 0.5
        sid = torch.where(real, sid, torch.full_like(sid, -1))
        out = distinct_slots(sid, real, S)
        assert torch.equal(out[real], sid[real])
        assert all(len(set(row)) == A for row in out.tolist())
        assert int(out.min()) >= 0 and int(out.max()) < S


def test_speculated_layer_counts_misses_on_the_device(monkeypatch):
    """The graph path of a bucket whose experts may not fit: no host read, a miss is
    counted on the device and graph_check sends the step back; with every needed expert
    resident the output is the fetch path's."""
    llm = LLM("demo", device="cpu", kv_cache_tokens=64, expert_offload=True, expert_cache_slots=4,
              expert_prefetch=False)
    cache = llm.engine.expert_cache
    moe, layer = cache.moes[0], cache.layers[0]
    monkeypatch.setattr(layer, "resolves", lambda rows: False)
    x = torch.randn(1, llm.config.hidden_size)  # top-2: fits the 4 slots
    with torch.inference_mode():
        want = moe(x)  # fetch: admits what x routes to
        hits = layer.stats.hits
        cache.force_speculate = True
        got = moe(x)
        assert cache.graph_check() is True
        assert layer.stats.hits > hits
        needed = [e for e in range(8) if int(layer.slot_table[e]) >= 0 and e in layer.owner]
        others = [e for e in range(8) if e not in layer.owner][:4]
        cache.force_speculate = False
        layer.admit(others)  # evicts every expert x needs
        cache.force_speculate = True
        moe(x)
        assert cache.graph_check() is False
        cache.live_rows.fill_(0)  # a bucket's padding rows: their misses do not count
        moe(x)
        assert cache.graph_check() is True
    torch.testing.assert_close(got, want)
    assert needed and int(layer.misses_dev) == 0  # graph_check resets the device counters


@pytest.fixture
def device_read_attention(monkeypatch) -> list[tuple[int, int]]:
    """The torch attention route made to read a decode call's lengths from the device
    (seq_lens), as the graph-safe Triton route does, so that a step run on a graph's static
    inputs computes on the CPU; each decode call's (rows, table width) recorded."""
    route = routes.ops()["attention"].get("torch")
    run, seen = route.run, []

    def run_decode(call):
        if not call.decode or call.pool is None:
            return run(call)
        B, W = call.block_tables.shape
        seen.append((B, W))
        return reference_paged_attention(call.q, call.pool, call.block_tables, list(range(B + 1)),
                                         call.seq_lens.tolist(), call.scale, call.window, call.sinks)

    monkeypatch.setattr(route, "run", run_decode)
    return seen


class StaticReplay(DecodeGraphs):
    """A stand-in for the decode graphs on the CPU: each "replay" runs the captured step
    function on the padded static inputs, eagerly, with the expert cache in its graph form;
    with `device_read_attention` it computes what the graph would."""

    cache: ExpertCache

    def ready(self, num_seqs: int, mode=None) -> bool:
        return self.bucket_for(num_seqs) is not None

    def run(self, num_seqs: int, mode=None):
        self.cache.force_speculate = True
        try:
            logits = self._step(self.bucket_for(num_seqs), mode)
        finally:
            self.cache.force_speculate = False
        return self.tokens[:num_seqs], logits[:num_seqs]


def _stand_in(llm: LLM, max_num_seqs: int = 4) -> ExpertCache:
    r = llm.engine.runner
    r.graphs = StaticReplay(r.model, r.inputs, r.sampling, r.kv_cache, max_num_seqs, r.device)
    r.graphs.cache = llm.engine.expert_cache
    return r.graphs.cache


def test_a_replay_with_a_miss_reruns_eagerly_with_the_penalty_counts_restored(device_read_attention):
    """One slot for top-2 routing: every replay misses, is discarded (the sampler's
    repetition counts restored), and the step runs again eagerly: the resident tokens."""
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3)
    want = [o.outputs[0].token_ids for o in LLM("demo", device="cpu", kv_cache_tokens=256).generate(PROMPTS, sp)]
    llm = LLM("demo", device="cpu", kv_cache_tokens=256, expert_offload=True, expert_cache_slots=1)
    cache = _stand_in(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)] == want
    assert (cache.graph_steps, cache.graph_reruns) == (0, sp.max_tokens - 1)  # every decode step


def test_a_rerun_has_the_graphs_shapes_over_a_long_generation(device_read_attention):
    """The decode attention picks its splits from the rows and the table width, so a
    rejected replay's rerun must see the bucket's padded rows and full width as the replay
    did, or once contexts pass a few dozen tokens it rounds differently (on the GPU). Three
    sequences pad to the bucket of 4; 70 tokens take the contexts past 64; the tokens are
    the resident engine's."""
    sp = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    prompts = PROMPTS + ["A third"]
    kw = dict(device="cpu", kv_cache_tokens=512, max_model_len=256)
    want = [o.outputs[0].token_ids for o in LLM("demo", **kw).generate(prompts, sp)]
    llm = LLM("demo", expert_offload=True, expert_cache_slots=2, **kw)
    cache, width = _stand_in(llm), llm.engine.runner.inputs.block_tables.shape[1]
    device_read_attention.clear()
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert min(len(o.prompt_token_ids) for o in outs) + sp.max_tokens > 64
    assert set(device_read_attention) == {(4, width)}  # never (3, the longest table's width)
    replays = sp.max_tokens - 1  # every decode step, then each rejected one once more
    assert cache.graph_reruns > 0
    assert len(device_read_attention) == (replays + cache.graph_reruns) * llm.config.num_layers


def _steps(llm: LLM, prompts) -> tuple[list[list[int]], list[dict]]:
    engine = llm.engine
    reqs = [engine.add_request(engine.tokenizer.encode(p), GREEDY) for p in prompts]
    steps = []
    while engine.has_unfinished():
        before = engine.expert_cache.totals()
        engine.step()
        after = engine.expert_cache.totals()
        steps.append({k: after[k] - before[k] for k in ("hits", "misses", "graph_steps", "graph_reruns")})
    return [r.output_token_ids for r in reqs], steps


@pytest.mark.parametrize("slots,prompts", [(2, PROMPTS), (6, PROMPTS), (6, PROMPTS + ["A third"]),
                                           (2, PROMPTS[:1]), (3, PROMPTS[:1])])
def test_replays_stand_or_rerun_exactly_when_an_eager_step_hits_or_misses(slots, prompts, device_read_attention):
    """Without prefetch the slots evolve the same through replays as through eager steps:
    each decode step has the eager step's hits and misses, and the tokens are the same
    (tests/gpu/test_expert_cache_gpu.py runs this against real graphs). A bucket whose
    experts always fit the slots (rows x top-2 <= slots) admits and copies its misses
    inside the replay, which always stands; a larger one counts them, and its replay stands
    exactly when the eager step hit in every layer and is rerun exactly when it missed.
    Three sequences pad to the bucket of 4: the padding row's experts are neither counted
    nor fetched, in the replay or in its rerun."""
    kw = dict(device="cpu", kv_cache_tokens=256, expert_offload=True, expert_cache_slots=slots,
              expert_prefetch=False, async_scheduling=False)  # step for step: each step read at once
    eager_tokens, eager = _steps(LLM("demo", **kw), prompts)
    llm = LLM("demo", **kw)
    _stand_in(llm)
    tokens, steps = _steps(llm, prompts)
    assert tokens == eager_tokens and len(steps) == len(eager)
    bucket = llm.engine.runner.graphs.bucket_for(len(prompts))
    resolved = llm.engine.expert_cache.layers[0].resolves(bucket)
    assert resolved == (2 * bucket <= slots)
    for i, (g, e) in enumerate(zip(steps, eager)):
        assert (g["hits"], g["misses"]) == (e["hits"], e["misses"]), (i, g, e)
        want = (0, 0) if i == 0 else ((0, 1) if e["misses"] and not resolved else (1, 0))  # 0: the prefill
        assert (g["graph_steps"], g["graph_reruns"]) == want, (i, g, e)
    assert sum(e["misses"] for e in eager[1:]) > 0  # decode steps that missed ...
    assert (sum(g["graph_reruns"] for g in steps) > 0) != resolved  # ... rerun, or resolved in the replay
    assert sum(g["graph_steps"] for g in steps) > 0 or slots == 2  # 2 slots, 2 rows: every step misses


def test_record_routing_replays_to_the_engine_counts(tmp_path):
    """The simulator, fed the engine's own trace, reproduces the engine's hits and misses."""
    path = tmp_path / "trace.jsonl"
    llm = LLM("demo", device="cpu", kv_cache_tokens=256, expert_offload=True, expert_cache_slots=3,
              expert_cache_policy="lru", expert_prefetch=False, record_routing=str(path))
    outs = llm.generate(PROMPTS, GREEDY)
    cache = llm.engine.expert_cache
    cache.detach()
    trace = load_trace(path)
    assert trace.num_experts == 8 and trace.top_k == 2 and len(trace.moe_layers) == 8
    assert len(trace.steps) == GREEDY.max_tokens  # one prefill step, then one decode step per token
    assert len(trace.steps[0][0]) == sum(len(o.prompt_token_ids) for o in outs)
    assert all(len(tok) == 2 for tok in trace.steps[-1][0]) and len(trace.steps[-1][0]) == 2
    assert trace.preds[0] is not None and len(trace.preds[0][0]) >= 2
    sim = simulate(trace, 3, "lru")
    t = cache.totals()
    assert (sim.hits, sim.misses) == (t["hits"], t["misses"])


def test_metrics_and_bench_record_expose_the_cache():
    engine = LLMEngine(EngineConfig(model="demo", device="cpu", kv_cache_tokens=64, expert_offload=True,
                                    expert_cache_slots=2))
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    text = render(engine, "demo")
    t = engine.expert_cache.totals()
    assert f'lowbit:expert_cache_misses_total{{model_name="demo"}} {t["misses"]}' in text
    assert f'lowbit:expert_cache_hits_total{{model_name="demo"}} {t["hits"]}' in text
    assert f'lowbit:expert_cache_bytes_copied_total{{model_name="demo"}} {t["bytes_copied"]}' in text
    assert t["bytes_copied"] > 0 and len(engine.expert_cache.layer_hit_rates()) == 8


@pytest.mark.parametrize("kw,msg", [
    (dict(expert_offload=True, expert_cache_slots=0), "positive integer"),
    (dict(expert_cache_slots=4), "add --expert-offload"),
    (dict(expert_offload=True, expert_cache_gib=-1.0), "positive number of GiB"),
    (dict(expert_offload=True, expert_cache_gib=1.0, expert_cache_slots=2), "not both"),
    (dict(expert_offload=True, tensor_parallel_size=2), "one GPU"),
])
def test_bad_flags_say_what_to_do(kw, msg):
    with pytest.raises(LowbitError, match=msg):
        EngineConfig(**kw).validate()


def test_cli_stats_line_shows_hits_and_misses(capsys):
    assert cli_main(["generate", "demo", "Once upon a time", "--device", "cpu", "--temperature", "0",
                     "--max-tokens", "4", "--kv-cache-tokens", "64", "--expert-offload",
                     "--expert-cache-slots", "3"]) == 0
    err = capsys.readouterr().err
    assert "[experts 3/8 per layer: hit " in err and " misses/tok, " in err and " MiB/tok]" in err


def test_cli_refuses_slots_without_offload(capsys):
    assert cli_main(["generate", "demo", "hi", "--device", "cpu", "--expert-cache-slots", "3"]) == 2
    assert "add --expert-offload" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["generate", "demo", "hi", "--expert-offload", "--expert-cache-slots", "many"])


def test_plan_slots():
    cfg = EngineConfig(expert_offload=True, expert_cache_gib=1.0)
    assert plan_slots(cfg, 48, 128, 2**20, None) == 2**30 // (48 * 2**20)  # 21
    cfg = EngineConfig(expert_offload=True, gpu_memory_utilization=0.5)
    assert plan_slots(cfg, 4, 128, 1000, 40_000) == 10
    assert plan_slots(cfg, 4, 8, 1000, 10**9) == 8  # never more than the experts
    assert plan_slots(cfg, 4, 8, 1000, None) == 8  # the CPU: host memory is the device's
    with pytest.raises(LowbitError, match="no room for one expert slot"):
        plan_slots(cfg, 4, 8, 1000, 3000)
    assert plan_slots(EngineConfig(expert_offload=True, expert_cache_slots=99), 4, 8, 1000, 0) == 8


def test_loader_places_only_routed_expert_stacks_on_the_host():
    filler = DeviceFiller(torch.nn.Linear(2, 2), "meta", experts_on_host=True)
    for name in ("w13", "w2", "b13", "b2"):
        assert filler.device_of(f"model.layers.3.mlp.experts.{name}").type == "cpu"
    for name in ("model.layers.3.mlp.gate.weight", "model.layers.3.mlp.shared_experts.gate_proj.weight",
                 "model.embed_tokens.weight"):
        assert filler.device_of(name).type == "meta"
    assert DeviceFiller(torch.nn.Linear(2, 2), "meta").device_of("m.experts.w13").type == "meta"


def test_a_warm_up_step_puts_its_admissions_back_and_keeps_the_map_true(monkeypatch):
    """The eager step before a capture (resolve form): the slot map's policy state and
    counters are put back, the slots it copied into are marked free, every expert the
    table calls resident is in its slot, and the replay after it admits the same misses
    and computes the same output."""
    llm = LLM("demo", device="cpu", kv_cache_tokens=64, expert_offload=True, expert_cache_slots=2,
              expert_prefetch=False)
    cache = llm.engine.expert_cache
    moe, layer = cache.moes[0], cache.layers[0]
    torch.manual_seed(0)
    with torch.inference_mode():
        moe(torch.randn(1, llm.config.hidden_size))  # eager: two experts resident
        resident = set(layer.owner)
        x = next(x for x in (torch.randn(1, llm.config.hidden_size) for _ in range(100))
                 if not set(route_ids(moe, x)) & resident)  # a token needing two other experts
        before = layer.map.state()
        cache.force_speculate = True
        monkeypatch.setattr(cache, "warming_up", lambda: True)
        y_warm = moe(x)
        for k, a, b in zip(layer.map.STATE, before, layer.map.state()):
            if k not in ("table", "owner", "pending"):
                assert torch.equal(a, b), k
        assert layer.owner == [-1, -1] and (layer.slot_table < 0).all()  # both slots were overwritten
        monkeypatch.setattr(cache, "warming_up", lambda: False)
        misses = layer.stats.misses
        y = moe(x)  # the replay
        cache.force_speculate = False
    assert layer.stats.misses == misses + 2 and sorted(layer.owner) == sorted(route_ids(moe, x))
    for e in layer.owner:
        assert torch.equal(layer.slots["w13.w"][layer.owner.index(e)], layer.host["w13.w"][e])
    torch.testing.assert_close(y, y_warm, rtol=0, atol=0)


def route_ids(moe, x: torch.Tensor) -> list[int]:
    from lowbit.kernels.router_op import route

    g = moe.gate
    ids, _ = route(x, g.weight.float(), None, moe.spec, None)
    return ids[0].tolist()


def test_pinned_arena_packs_stacks_into_power_of_two_chunks():
    """The arena copies each tensor into the first chunk with room, aligned; a tensor over the
    chunk size gets a chunk of the next power of two; a view of a chunk is not copied again."""
    from lowbit.engine.expert_cache import PinnedArena

    made = []

    def alloc(n):
        made.append(n)
        return torch.full((n,), 0xAB, dtype=torch.uint8)

    arena = PinnedArena(True, alloc)
    arena.CHUNK = 4096
    g = torch.Generator().manual_seed(0)
    ts = [torch.randint(0, 255, (700,), dtype=torch.uint8, generator=g),
          torch.randn(3, 50, generator=g).to(torch.bfloat16),
          torch.randint(-9, 9, (5, 7), dtype=torch.int32, generator=g),
          torch.randn(3000, generator=g),  # 12,000 bytes: a chunk of 16,384
          torch.randn(64, 4, generator=g)[:, 1]]  # not contiguous
    out = [arena.take(t) for t in ts]
    for t, o in zip(ts, out):
        assert o.dtype == t.dtype and o.shape == t.shape and torch.equal(o, t)
        assert (o.data_ptr() - o.untyped_storage().data_ptr()) % arena.ALIGN == 0
    assert made == [4096, 16384]  # the float32 tensor gets its own chunk; the rest fit the first
    assert out[2].untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr()
    assert arena.take(out[1][1]).data_ptr() == out[1][1].data_ptr()  # a view of a chunk stays put
    assert arena.reserved == sum(made) and arena.used <= arena.reserved
    assert PinnedArena(False).take(ts[1]).data_ptr() == ts[1].data_ptr()  # no pinning: the CPU tensor itself


@pytest.mark.parametrize("slots", [4, 6])
def test_graph_form_prefetch_keeps_the_tokens_and_turns_misses_into_prefetch_hits(slots, device_read_attention, caplog):
    """--expert-prefetch-graphs: each resolve-form decode step also admits the next layer's
    router top-k (of this layer's input) and copies it before this layer's experts run. One
    sequence (2 experts a layer, within half of 4 or 6 slots): the tokens are the resident
    model's, every decode step replays, and the decode steps miss less than without it
    while the prefetched experts are used."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM("demo", device="cpu", kv_cache_tokens=256).generate(PROMPTS[:1], sp)]
    runs = {}
    for graphs in (False, True):
        llm = LLM("demo", device="cpu", kv_cache_tokens=256, expert_offload=True, expert_cache_slots=slots,
                  expert_prefetch_graphs=graphs, async_scheduling=False)
        cache = _stand_in(llm)
        assert cache.graph_prefetch == graphs
        # the flag is MEASURED-NEGATIVE on a GPU: a user who turns it on is told so
        assert ("MEASURED-NEGATIVE" in caplog.text) == graphs
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1))  # the prompt's prefill
        before = cache.totals()
        outs = llm.generate(PROMPTS[:1], sp)
        after = cache.totals()
        assert [o.outputs[0].token_ids for o in outs] == want
        assert cache.graph_reruns == 0 and after["graph_steps"] - before["graph_steps"] == sp.max_tokens - 1
        runs[graphs] = {k: after[k] - before[k] for k in ("misses", "prefetched", "prefetch_hits")}
    assert runs[True]["prefetched"] > runs[False]["prefetched"]  # graph steps prefetch only with the flag
    assert runs[True]["prefetch_hits"] > 0
    assert runs[True]["misses"] < runs[False]["misses"], runs
