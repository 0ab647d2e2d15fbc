"""DeepSeek decode through the `triton_latent_decode` route (interpreter, forced) against the
torch route: shrunk V2-Lite and V3 configs with random weights over a paged cache, prompts
of different lengths prefilled by the torch route, then decode steps whose logits must
agree; and the engine's graph decision for an MLA model follows the latent op's routes."""

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.checkpoint.loader import load_model  # noqa: E402
from lowbit.engine.cuda_graphs import graphs_wanted  # noqa: E402
from lowbit.engine.paged_cache import FP8, PagedKVCache  # noqa: E402
from lowbit.engine.speculative import flat_batch  # noqa: E402
from lowbit.kernels import routes  # noqa: E402
from lowbit.kernels.runtime import interpreting  # noqa: E402
from tests.models.test_random_weights import raw_config, shrink  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")

ENV = "LOWBIT_ROUTE_LATENT_ATTENTION"
TABLES = [[3, 9, 1, 12], [0, 7, 5, 14], [2, 11, 4, 8]]  # block size 4: up to 16 tokens each
PROMPTS = [5, 9, 2]


def tiny(tmp_path, name: str):
    """The shrunk config with 18 heads (one full and one partial head block of 16) and a
    latent of 40 (padded to 64 in the kernel)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**shrink(raw_config(name)), "num_attention_heads": 18, "kv_lora_rank": 40}))
    return load_model(path, random_weights=True, config=path, dtype="float32").model


def _logits(lm, cache, ids, starts, news, route: str | None, monkeypatch):
    if route is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, route)
    batch = flat_batch([(t, s, n) for t, s, n in zip(TABLES, starts, news)], cache, "cpu")
    with torch.inference_mode():
        hidden = lm(ids, batch)
        last = torch.tensor(batch.query_start[1:]) - 1
        return lm.compute_logits(hidden[last])


@pytest.mark.parametrize("name,kv", [("deepseek-ai__DeepSeek-V2-Lite", torch.float32),
                                     ("deepseek-ai__DeepSeek-V2-Lite", FP8),
                                     ("deepseek-ai__DeepSeek-V3", torch.float32)])
def test_decode_steps_through_the_latent_kernel_match_the_torch_route(tmp_path, monkeypatch, name, kv):
    lm = tiny(tmp_path, name)
    cache = PagedKVCache(lm.num_cache_layers, num_blocks=16, block_size=4, dtype=kv, device="cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, lm.config.vocab_size, (sum(PROMPTS),), generator=g)
    logits = _logits(lm, cache, ids, [0, 0, 0], PROMPTS, None, monkeypatch)  # prefill: torch route
    lens = list(PROMPTS)
    for _ in range(4):  # sequence 1 crosses into its fourth block
        ids = logits.argmax(-1)
        routes.reset_counters()
        got = _logits(lm, cache, ids, lens, [1, 1, 1], "triton_latent_decode", monkeypatch)
        ran = {c["route"] for c in routes.counters()["route_calls"] if c["op"] == "latent_attention"}
        assert ran == {"triton_latent_decode"}
        want = _logits(lm, cache, ids, lens, [1, 1, 1], "torch", monkeypatch)  # rewrites the same rows
        assert (got - want).abs().max() < 1e-4 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        logits, lens = want, [n + 1 for n in lens]


@pytest.mark.parametrize("name", ["deepseek-ai__DeepSeek-V2-Lite", "deepseek-ai__DeepSeek-V3"])
def test_prefill_and_mixed_steps_through_the_latent_kernel_match_the_torch_route(tmp_path, monkeypatch, name):
    """Prompts, then a mixed step (two decode tokens beside a 4-token chunk), each through the
    forced prefill route on one cache and the torch route on another: the same logits."""
    lm = tiny(tmp_path, name)
    caches = {r: PagedKVCache(lm.num_cache_layers, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu")
              for r in ("triton_latent_prefill", "torch")}
    g = torch.Generator().manual_seed(1)
    steps = [([0, 0, 0], PROMPTS), ([5, 9, 2], [1, 1, 4])]
    for starts, news in steps:
        ids = torch.randint(0, lm.config.vocab_size, (sum(news),), generator=g)
        out = {}
        for route, cache in caches.items():
            routes.reset_counters()
            out[route] = _logits(lm, cache, ids, starts, news, route, monkeypatch)
            ran = {c["route"] for c in routes.counters()["route_calls"] if c["op"] == "latent_attention"}
            assert ran == {route}
        got, want = out["triton_latent_prefill"], out["torch"]
        assert (got - want).abs().max() < 1e-4 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_graph_decision_follows_the_latent_op(tmp_path, monkeypatch):
    lm = tiny(tmp_path, "deepseek-ai__DeepSeek-V2-Lite")
    cuda = torch.device("cuda")  # graphs_wanted only looks at the device type
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("LOWBIT_ROUTE_ATTENTION", "torch")  # the GQA op does not concern MLA
    assert lm.supports_cuda_graphs and graphs_wanted(lm, cuda, False) is None
    monkeypatch.setenv(ENV, "torch")
    assert graphs_wanted(lm, cuda, False) == f"{ENV}=torch is not a graph-safe decode route"


@pytest.mark.parametrize("name,kv", [("deepseek-ai__DeepSeek-V2-Lite", torch.float32),
                                     ("deepseek-ai__DeepSeek-V2-Lite", FP8),
                                     ("deepseek-ai__DeepSeek-V3", torch.float32)])
def test_fused_layer_matches_the_torch_routes(tmp_path, monkeypatch, name, kv):
    """The serving layout (merged projections, merged shared gate/up) with the Triton
    mla_rope route writing the latent (no kv_write call) and the latent kernels, prefill then
    decode steps on one cache, against the same model on the torch routes on another."""
    lm = tiny(tmp_path, name)
    lm.prepare_for_serving()
    attn = lm.model.layers[0].self_attn
    assert attn.qkv_a_proj is not None and attn.kv_a_proj_with_mqa is None
    assert lm.model.layers[-1].mlp.shared_experts.gate_up_proj is not None
    caches = [PagedKVCache(lm.num_cache_layers, num_blocks=16, block_size=4, dtype=kv, device="cpu")
              for _ in range(2)]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, lm.config.vocab_size, (sum(PROMPTS),), generator=g)
    starts, news = [0, 0, 0], PROMPTS
    for step in range(4):
        latent = "triton_latent_decode" if step else "triton_latent_prefill"
        monkeypatch.setenv("LOWBIT_ROUTE_MLA_ROPE", "triton_mla_rope")
        routes.reset_counters()
        got = _logits(lm, caches[0], ids, starts, news, latent, monkeypatch)
        ran = {(c["op"], c["route"]) for c in routes.counters()["route_calls"]
               if c["op"] in ("mla_rope", "latent_attention", "kv_write")}
        assert ran == {("mla_rope", "triton_mla_rope"), ("latent_attention", latent)}
        monkeypatch.setenv("LOWBIT_ROUTE_MLA_ROPE", "torch")
        want = _logits(lm, caches[1], ids, starts, news, "torch", monkeypatch)
        assert (got - want).abs().max() < 1e-4 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        starts = [s + n for s, n in zip(starts, news)]
        news, ids = [1, 1, 1], want.argmax(-1)


def _launches(monkeypatch, modules, forward):
    """(forward(), the launches made inside `modules`' forwards): Triton kernels through
    launch.run by name, torch ops by their aten name. Views and empty allocations launch
    nothing and are left out, and so are the interpreter's own tensor ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lowbit.kernels import launch

    events, inside = [], [None]
    free = {"view", "_unsafe_view", "transpose", "split", "split_with_sizes", "slice", "select", "t",
            "unsqueeze", "squeeze", "as_strided", "permute", "alias", "detach", "detach_", "empty",
            "empty_like", "new_empty", "empty_strided", "reshape", "to", "promote_types", "lift_fresh"}

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if inside[0] is not None and name not in free:
                events.append(name)
            return func(*args, **(kwargs or {}))

    run = launch.run

    def counted(kernel, grid, *args, **kw):
        if inside[0] is not None:
            events.append(kernel.fn.__name__)
        outer, inside[0] = inside[0], None
        try:
            return run(kernel, grid, *args, **kw)
        finally:
            inside[0] = outer

    monkeypatch.setattr(launch, "run", counted)
    hooks = [h for m in modules for h in (m.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, m)),
                                          m.register_forward_hook(lambda m, a, out: inside.__setitem__(0, None)))]
    try:
        with torch.inference_mode(), Ops():
            out = forward()
    finally:
        for h in hooks:
            h.remove()
        monkeypatch.setattr(launch, "run", run)
    return out, events


def test_decode_layer_launches(tmp_path, monkeypatch):
    """What one MLA attention block and one gate_up MLP of the serving layout launch in a
    decode step, Triton routes forced (on the GPU they are the defaults): the merged
    projection, mla_rope, the absorbed q product, the latent split kernel (S = 1 here: no
    reduce), the absorbed o product, o_proj; gate_up, silu_mul, down. Views and empty
    allocations launch nothing and are left out."""
    from lowbit.models.deepseek_v3 import GateUpMLP, MLAttention

    lm = tiny(tmp_path, "deepseek-ai__DeepSeek-V2-Lite")
    lm.prepare_for_serving()
    cache = PagedKVCache(lm.num_cache_layers, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu")
    for op, route in (("MLA_ROPE", "triton_mla_rope"), ("ACT", "triton_silu_mul"),
                      ("LATENT_ATTENTION", "triton_latent_prefill")):
        monkeypatch.setenv(f"LOWBIT_ROUTE_{op}", route)
    with torch.inference_mode():
        lm(torch.tensor([1, 2, 3]), flat_batch([(TABLES[0], 0, 3)], cache, "cpu"))
    monkeypatch.setenv(ENV, "triton_latent_decode")
    layer = lm.model.layers[1]
    assert isinstance(layer.self_attn, MLAttention) and isinstance(layer.mlp.shared_experts, GateUpMLP)
    _, events = _launches(monkeypatch, (layer.self_attn, layer.mlp.shared_experts),
                          lambda: lm(torch.tensor([7]), flat_batch([(TABLES[0], 3, 1)], cache, "cpu")))
    attn = ["linear", "_mla_rope_kernel", "bmm", "_latent_split_kernel", "bmm", "linear"]
    assert events == attn + ["linear", "_silu_mul_kernel", "linear"], events


def test_moe_layer_decode_launches_in_the_serving_layout(tmp_path, monkeypatch):
    """A bf16 MoE layer's decode step in the serving layout (prepare_for_serving: merged
    projections, merged shared gate_up), the fused routes forced (both OPT_IN until their
    engine record) with a graph-wide split count (4): the latent reduce applies W_UV (no bmm
    after it), and the routed gemv launches carry the shared experts (no gate_up / down GEMM,
    SiLU-mul or add): 8 launches. The logits match the torch routes'."""
    from lowbit.kernels import latent

    path = tmp_path / "config.json"
    cfg = shrink(raw_config("deepseek-ai__DeepSeek-V2-Lite"))
    path.write_text(json.dumps({**cfg, "num_attention_heads": 18, "kv_lora_rank": 40}))
    lm = load_model(path, random_weights=True, config=path, dtype="bfloat16").model
    lm.prepare_for_serving()
    monkeypatch.setattr(latent, "decode_splits", lambda *a: 4)
    layer = lm.model.layers[1]
    assert layer.mlp.shared_experts.gate_up_proj is not None

    def step(forced: bool):
        cache = PagedKVCache(lm.num_cache_layers, num_blocks=16, block_size=4, dtype=torch.bfloat16, device="cpu")
        for op in ("MLA_ROPE", "ACT", "LATENT_ATTENTION", "MOE"):
            monkeypatch.delenv(f"LOWBIT_ROUTE_{op}", raising=False)
        with torch.inference_mode():
            lm(torch.tensor([1, 2, 3]), flat_batch([(TABLES[0], 0, 3)], cache, "cpu"))
        if forced:
            for op, route in (("MLA_ROPE", "triton_mla_rope"), ("LATENT_ATTENTION", "triton_latent_decode_uv"),
                              ("MOE", "triton_moe_dense_shared")):
                monkeypatch.setenv(f"LOWBIT_ROUTE_{op}", route)
        hidden, events = _launches(monkeypatch, (layer.self_attn, layer.mlp.experts),
                                   lambda: lm(torch.tensor([7]), flat_batch([(TABLES[0], 3, 1)], cache, "cpu")))
        return lm.compute_logits(hidden).float(), events

    from lowbit.kernels.runtime import semaphore

    semaphore(torch.device("cpu"), 1)  # the split-K counters: allocated once a process, not a step's launch
    fused, events = step(True)
    assert events == ["linear", "_mla_rope_kernel", "bmm", "_latent_split_kernel", "_latent_reduce_uv_kernel",
                      "linear", "_gemv_kernel", "_gemv_kernel"], events
    want, _ = step(False)
    assert torch.isfinite(fused).all()
    assert (fused - want).abs().max() < 5e-2 * want.abs().max()
