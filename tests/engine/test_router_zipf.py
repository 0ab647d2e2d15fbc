"""--router-zipf: random-weight routers biased toward Zipf popularity, the popularity fit of
`lowbit bench expert-cache`, and bench latency's --temperature around them."""

from __future__ import annotations

import json

import pytest
import torch

from lowbit.bench.expert_cache import popularity, zipf_trace
from lowbit.checkpoint.loader import load_model, zipf_router_
from lowbit.cli import main as cli_main
from lowbit.config import EngineConfig
from lowbit.engine.expert_policy import RoutingTrace
from lowbit.errors import LowbitError
from lowbit.kernels.router_op import route
from lowbit.layers.moe import SparseMoE

E, TOP_K, D = 64, 4, 256


def moe_config(tmp_path, layers: int = 2) -> str:
    cfg = json.load(open("lowbit/model_configs/Qwen__Qwen3-30B-A3B.json"))
    cfg.update(num_hidden_layers=layers, max_window_layers=layers, hidden_size=D, moe_intermediate_size=32,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512,
               num_experts=E, num_experts_per_tok=TOP_K)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def routed_trace(model, tokens: int, seed: int) -> RoutingTrace:
    """Each MoE layer's choice for `tokens` fresh RMS-normalised random inputs (what the
    router sees in a decode step with sampled tokens), as a trace of one-token steps."""
    g = torch.Generator().manual_seed(seed)
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    x = torch.randn(tokens, D, generator=g)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    ids = []
    for m in moes:
        b = None if m.gate.bias is None else m.gate.bias.float()
        ids.append(route(x, m.gate.weight.float(), b, m.spec, None)[0].tolist())
    trace = RoutingTrace(E, TOP_K, list(range(len(moes))))
    for t in range(tokens):
        trace.steps.append([[layer[t]] for layer in ids])
        trace.preds.append(None)
    return trace


def test_bias_follows_the_seeded_ranking(tmp_path):
    model = load_model("x", random_weights=True, config=moe_config(tmp_path), dtype="float32").model
    ranks = zipf_router_(model, 1.0)
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert len(ranks) == len(moes) == 2
    assert not torch.equal(ranks[0], ranks[1]), "every layer has its own hot set"
    for m, order in zip(moes, ranks):
        b = m.gate.bias[order]  # biases in rank order: strictly falling, 0 at rank 1
        assert b[0] == 0 and (b[1:] < b[:-1]).all()
        # -c * ln(rank): one factor c per layer
        r = torch.arange(2, E + 1, dtype=torch.float64)
        c = -b[1:].double() / r.log()
        assert torch.allclose(c, c[0].expand_as(c), rtol=1e-2) and c[0] > 0
    before = [m.gate.bias.clone() for m in moes]
    zipf_router_(model, 1.0)  # a second engine on the same model: no second bias
    assert all(torch.equal(a, m.gate.bias) for a, m in zip(before, moes))
    with pytest.raises(LowbitError, match="already carry"):
        zipf_router_(model, 0.5)


def test_biased_routing_is_skewed_like_a_drawn_zipf_trace(tmp_path):
    """Uniform random routing spreads the picks; the biased router puts most of them on its
    top quarter, within reach of a trace drawn from Zipf(1.0) itself."""
    cfg = moe_config(tmp_path)
    plain = load_model("x", random_weights=True, config=cfg, dtype="float32").model
    biased = load_model("x", random_weights=True, config=cfg, dtype="float32").model
    zipf_router_(biased, 1.0)
    n = 2048
    p0 = popularity(routed_trace(plain, n, 1))
    p1 = popularity(routed_trace(biased, n, 1))
    drawn = popularity(zipf_trace(E, TOP_K, 2, n, 1.0, seed=3))
    assert p0["top_quarter_share"]["max"] < 0.45
    assert p1["top_quarter_share"]["min"] > 0.6
    assert abs(p1["top_quarter_share"]["mean"] - drawn["top_quarter_share"]["mean"]) < 0.05
    assert 0.8 < p1["zipf_fit"]["mean"] < 1.3
    assert p0["zipf_fit"]["mean"] < 0.5 * p1["zipf_fit"]["mean"]


def test_popularity_of_known_traces():
    one = RoutingTrace(8, 1, [0], [[[[e]]] for e in [0] * 6 + [1, 1, 2]], [None] * 9)
    pop = popularity(one)
    assert pop["top_quarter_share"]["mean"] == pytest.approx(8 / 9, abs=1e-4)  # top 2 of 8 experts: 6 + 2 of 9 picks
    # counts 6, 2, 1 at ranks 1, 2, 3: the log-log least-squares slope, negated
    x = torch.log(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    y = torch.log(torch.tensor([6.0, 2.0, 1.0], dtype=torch.float64))
    slope = ((x - x.mean()) * (y - y.mean())).sum() / (x - x.mean()).pow(2).sum()
    assert pop["zipf_fit"]["mean"] == pytest.approx(-float(slope), abs=1e-4)
    with pytest.raises(LowbitError, match="routes no tokens"):
        popularity(RoutingTrace(8, 1, [0], [], []))


def test_router_zipf_needs_random_weights():
    with pytest.raises(LowbitError, match="random-weight"):
        EngineConfig(model="demo", router_zipf=1.0).validate()
    with pytest.raises(LowbitError, match=r"\[0, 4\]"):
        EngineConfig(model="x", random_weights=True, config="c.json", router_zipf=-1.0).validate()
    EngineConfig(model="x", random_weights=True, config="c.json", router_zipf=1.0).validate()


def test_bench_latency_temperature_and_zipf_reach_the_record(tmp_path, capsys):
    rc = cli_main(["bench", "latency", "x", "--random-weights", "--config", moe_config(tmp_path), "--device",
                   "cpu", "-p", "8", "-n", "8", "-d", "0", "-r", "1", "--temperature", "1", "--router-zipf", "1",
                   "--expert-offload", "--expert-cache-slots", "8", "--kv-cache-tokens", "256", "-o", "json",
                   "--records", str(tmp_path / "rec")])
    assert rc == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["temperature"] == 1.0 and rec["router_zipf"] == 1.0
    ec = rec["expert_cache"]
    assert ec["hits"] + ec["misses"] > 0


def test_bench_latency_warns_on_greedy_offload_and_refuses_temperature_with_spec(tmp_path, capsys):
    cfg = moe_config(tmp_path, layers=1)
    rc = cli_main(["bench", "latency", "x", "--random-weights", "--config", cfg, "--device", "cpu", "-p", "8",
                   "-n", "4", "-d", "0", "-r", "1", "--expert-offload", "--expert-cache-slots", "8",
                   "--kv-cache-tokens", "256", "-o", "json", "--records", str(tmp_path / "rec")])
    assert rc == 0
    assert "greedy decoding of random weights" in capsys.readouterr().err
    rc = cli_main(["bench", "latency", "demo", "--spec", "ngram", "--temperature", "1", "--device", "cpu"])
    assert rc != 0
    assert "--temperature samples the plain tg cells" in capsys.readouterr().err
