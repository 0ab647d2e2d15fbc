"""Speculative decoding through the engine (lowbit.engine.speculative): greedy output is the
output without speculation for every method, token frequencies at temperature 1 with top-p
agree with those without it, and rejected drafts leave nothing behind (blocks, lengths,
prefix cache)."""

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import lowbit
from lowbit import LLM, SamplingParams
from lowbit.config import EngineConfig
from lowbit.engine.batch import ForwardBatch
from lowbit.engine.block_manager import BlockManager
from lowbit.engine.kv_cache import ContiguousKVCache
from lowbit.engine.request import Request
from lowbit.engine.speculative import NgramDrafter, NgramIndex, SpecStats, ngram_lookup
from lowbit.errors import LowbitError
from lowbit.kernels import routes
from lowbit.server.metrics import render
from tests.engine.helpers import run_all, tokens_of
from tests.engine.test_acceptance import chi2_sf
from tests.models.test_random_weights import raw_config, shrink

DEMO = Path(lowbit.__file__).parent / "demo_model"
needs_demo = pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="the demo model is not installed")
PROMPTS = ["It is a truth universally acknowledged", "In the beginning", "HAMLET.\nTo be, or not to be"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def random_draft(path: Path, vocab: int) -> Path:
    """A 1-layer random qwen3_moe checkpoint: a draft that is mostly wrong."""
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).eval().float().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def draft_4096(tmp_path_factory):
    return str(random_draft(tmp_path_factory.mktemp("draft_4096"), 4096))


@pytest.fixture(scope="module")
def demo_perturbed(tmp_path_factory):
    """The demo model's first 4 of 8 layers: a cheaper draft whose distributions are near the
    target's but not equal, so drafts are both accepted and rejected."""
    path = tmp_path_factory.mktemp("demo_perturbed")
    (path / "config.json").write_text(json.dumps({**json.loads((DEMO / "config.json").read_text()),
                                                  "num_hidden_layers": 4}))
    tensors = {k: v for k, v in load_file(DEMO / "model.safetensors").items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < 4}
    save_file(tensors, path / "model.safetensors")
    return str(path)


@pytest.fixture(scope="module")
def demo():
    return LLM("demo", kv_cache_tokens=4096, max_num_batched_tokens=64, max_num_seqs=128)


def spec_llm(base: LLM, method: str, k: int = 3, **kw) -> LLM:
    cfg = base.engine.config
    args = dict(kv_cache_tokens=cfg.kv_cache_tokens, max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=cfg.max_num_seqs, block_size=cfg.block_size, loaded=base.loaded)
    return LLM(cfg.model, random_weights=cfg.random_weights, config=cfg.config,
               speculative_method=method, num_speculative_tokens=k, **{**args, **kw})


def outputs(llm: LLM, prompts, sp) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


_plain: dict = {}


def plain_outputs(llm: LLM, prompts, sp) -> list[list[int]]:
    """outputs() of an engine without speculation, computed once per engine and request."""
    key = (id(llm), repr(prompts), repr(sp))
    if key not in _plain:
        _plain[key] = outputs(llm, prompts, sp)
    return _plain[key]


def gauge(text: str, name: str) -> float:
    """The value of an unlabelled-by-us series in a /metrics text."""
    line = next(ln for ln in text.splitlines() if ln.startswith(name + "{") and "position" not in ln)
    return float(line.rsplit(" ", 1)[1])


def assert_idle(llm: LLM) -> None:
    eng = llm.engine
    assert eng.blocks.num_free_blocks == eng.blocks.num_total_blocks
    assert not eng.runner.rows and len(eng.runner.free_rows) == eng.config.max_num_seqs


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # the latest occurrence
    assert ngram_lookup([5, 6, 1, 2, 4, 8, 6, 1, 2], 3) == [4, 8, 6]  # the longest suffix first
    assert ngram_lookup([4, 4], 3) == [4]
    assert ngram_lookup([1, 2, 3], 3) == []


@pytest.mark.parametrize("vocab", [2, 3, 7, 100])
def test_the_ngram_index_answers_as_the_scan_while_the_tokens_grow(vocab):
    """The drafter's incremental index against the scan, each step of a growing list (small
    vocabularies: many and overlapping matches), and a list it did not index (cut short, or
    its last indexed token changed) indexed anew. A request's tokens only grow."""
    import random
    rng = random.Random(vocab)
    for _ in range(40):
        ids, index = [rng.randrange(vocab)], NgramIndex()
        for _ in range(40):
            k = rng.randrange(1, 8)
            assert index.lookup(ids, k) == ngram_lookup(ids, k), (ids, k)
            ids = ids + [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]
        for other in (ids[:len(ids) // 2], ids[:-2] + [vocab + 1] + ids[-1:]):
            assert index.lookup(other, 5) == ngram_lookup(other, 5)
    drafter = NgramDrafter()
    req = Request("r", [1, 2, 3, 1, 2], SamplingParams(), 4)
    assert drafter.plan(req, 2) == [3, 1] and "r" in drafter.index
    drafter.release("r")
    assert not drafter.index


def test_trim_gives_back_draft_blocks_first_in_line():
    bm = BlockManager(8, 4)
    req = Request("r", list(range(6)), SamplingParams(), 8)
    bm.allocate(req, [], 6 + 5)  # 6 tokens + 5 draft slots: 3 blocks
    assert len(req.block_table) == 3 and bm.num_free_blocks == 5
    dropped = req.block_table[2]
    bm.trim(req, 7)  # one draft accepted: 7 tokens need 2 blocks
    assert len(req.block_table) == 2 and bm.num_free_blocks == 6
    assert next(iter(bm.free_ids)) == dropped  # reused first: it holds nothing worth keeping
    bm.trim(req, 8)
    assert len(req.block_table) == 2


def test_spec_stats():
    s = SpecStats()
    s.record(3, 1)
    s.record(2, 2)
    assert s.mean_accepted_length == 2.5 and s.accept_rate_per_position == [1.0, 0.5, 0.0]


@pytest.mark.parametrize("bad,match", [
    (dict(num_speculative_tokens=2), "need"), (dict(speculative_method="draft"), "speculative-model"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "1..16"),
    (dict(speculative_method="ngram", speculative_model="x"), "speculative-model"),
    (dict(speculative_synthetic_accept=0.5), "need"), (dict(speculative_adaptive=True), "need"),
    (dict(speculative_method="ngram", speculative_synthetic_accept=1.5), r"\[0, 1\]")])
def test_flags_are_checked(bad, match):
    with pytest.raises(LowbitError, match=match):
        EngineConfig(**bad).validate()
    assert EngineConfig(speculative_method="mtp").num_draft_tokens == 3


def test_synthetic_acceptance_is_no_flag_of_generate_or_serve():
    for server in (False, True):
        parser = argparse.ArgumentParser()
        EngineConfig.add_cli_args(parser, server=server)
        flags = [f for a in parser._actions for f in a.option_strings]
        assert "--speculative-method" in flags and not any("synthetic" in f for f in flags)


@pytest.mark.parametrize("p", [0.0, 0.7, 1.0])
def test_synthetic_acceptance_is_a_geometric_run(make_engine, p):
    """Synthetic acceptance P, k = 3, 8 requests of random tokens (prompt lookup finds little:
    drafts are padded) for 40 verify steps: every verify step carries k drafts, and the
    accepted length L = 1 + N (N drafts kept before the first refusal, P(N >= j) = P^j for
    j <= k) has mean 1 + P + P^2 + P^3. The measured mean over the 320 sequence-steps is
    within 4 standard errors of it (the sd from N's exact variance; a correct engine fails
    with probability 6e-5 over the generator's seed), exactly k + 1 at P = 1 and 1 at P = 0.
    Rollback leaves the pool whole."""
    k, steps, seqs = 3, 40, 8
    eng = make_engine(speculative_method="ngram", num_speculative_tokens=k, speculative_synthetic_accept=p,
                      max_num_seqs=seqs)
    g = torch.Generator().manual_seed(1)
    for _ in range(seqs):
        eng.add_request(torch.randint(0, 250, (8,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(steps + 1):  # the prefill, then verify steps
        eng.step()
    s = eng.spec.stats
    assert s.num_steps == steps * seqs and s.num_drafts == k * s.num_steps
    mean_n = sum(p ** j for j in range(1, k + 1))
    var_n = sum((2 * j - 1) * p ** j for j in range(1, k + 1)) - mean_n ** 2
    assert abs(s.mean_accepted_length - (1 + mean_n)) <= 4 * (var_n / s.num_steps) ** 0.5
    if p in (0.0, 1.0):
        assert s.mean_accepted_length == 1 + k * p
    for j, rate in enumerate(s.accept_rate_per_position):  # P^(j+1), the share kept through j
        assert abs(rate - p ** (j + 1)) <= 4 * (p ** (j + 1) * (1 - p ** (j + 1)) / s.proposed_at[j]) ** 0.5
    for rid in list(eng.requests):
        eng.abort(rid)
    eng.step()
    assert eng.blocks.num_free_blocks == eng.blocks.num_total_blocks


@needs_demo
@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-random"])
def test_demo_greedy_is_the_same_with_speculation(demo, method, draft_4096):
    kw = {}
    if method != "ngram":
        kw["speculative_model"] = "demo" if method == "draft-self" else draft_4096
    llm = spec_llm(demo, method.split("-")[0], **kw)
    assert outputs(llm, PROMPTS, GREEDY) == plain_outputs(demo, PROMPTS, GREEDY)
    stats = llm.engine.spec.stats
    assert stats.num_steps > 0 and stats.num_drafts > 0
    if method == "draft-self":  # the target drafting for itself: every draft is its own choice
        assert stats.num_accepted == stats.num_drafts
    else:
        assert 0 <= stats.num_accepted < stats.num_drafts
    assert_idle(llm)


@needs_demo
@pytest.mark.parametrize("method", ["ngram", "draft-random"])
def test_demo_speculation_reading_every_rows_logits(demo, method, draft_4096, monkeypatch):
    """A verify step that replayed a HIDDEN graph of few tokens gets the logits and argmax of
    every row of the step (CUDA only; stood in for here by the same rows computed eagerly).
    Greedy steps read the argmax alone and pick the verify rows on the host: the output is
    still the output without speculation, for host (n-gram) and device (draft model) drafts,
    and every verify step took that path. Sampled steps gather their rows of the logits: the
    same output as the verify computing its own logits (same seed)."""
    kw = {} if method == "ngram" else {"speculative_model": draft_4096}
    llm = spec_llm(demo, method.split("-")[0], **kw)
    spec = llm.engine.spec
    real, calls = spec.verify, []

    def verify(scheduled, query_start, hidden, model, *args, graph_rows=None, **kwargs):
        calls.append(hidden.shape[0])
        logits = model.compute_logits(hidden)
        return real(scheduled, query_start, hidden, model, *args, graph_rows=(logits.argmax(-1), logits),
                    **kwargs)

    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
    want = outputs(llm, PROMPTS, sampled)  # the verify computes its own logits
    monkeypatch.setattr(spec, "verify", verify)
    assert outputs(llm, PROMPTS, GREEDY) == plain_outputs(demo, PROMPTS, GREEDY)
    assert calls and spec.graph_argmax_steps == len(calls)
    assert spec.stats.num_drafts > 0 and (spec.stats.num_accepted > 0 or method != "ngram")
    calls.clear()
    greedy_steps = spec.graph_argmax_steps
    assert outputs(llm, PROMPTS, sampled) == want
    assert calls and spec.graph_argmax_steps == greedy_steps  # sampled: the logits' gather
    assert_idle(llm)


@needs_demo
def test_demo_greedy_is_the_same_with_adaptive_k(demo):
    """--speculative-adaptive on the wall-clock: steps with 0 to 3 drafts mix (warm-up takes
    each in turn, then the engine's choice and its exploration), and greedy output is still
    the output without speculation."""
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm = spec_llm(demo, "ngram", speculative_adaptive=True)
    assert outputs(llm, PROMPTS, sp) == plain_outputs(demo, PROMPTS, sp)
    adapt = llm.engine.spec.adapt
    assert adapt.history and set(adapt.current()) == {4}  # 3 sequences: the bucket of 4
    assert set(adapt.buckets[4].verify) == {1, 2, 3, 4}
    assert_idle(llm)


@needs_demo
def test_demo_rollback_keeps_lengths_blocks_and_prefix_cache(demo, draft_4096):
    """After every step of a run whose drafts are mostly rejected: no draft left over, each
    request one token short of computed, only the blocks its tokens need, and every cached
    block holding the request's real tokens. A second run reuses the prefix and agrees."""
    llm = spec_llm(demo, "draft", speculative_model=draft_4096, block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eng = llm.engine
    for p in PROMPTS:
        eng.add_request(llm.prompts.encode(p), sp)
    deltas, bs, rejected = {}, eng.blocks.block_size, 0
    while eng.has_unfinished():
        before = eng.spec.stats.num_drafts - eng.spec.stats.num_accepted
        for d in eng.step():
            deltas.setdefault(d.request_id, []).append(d)
        rejected += eng.spec.stats.num_drafts - eng.spec.stats.num_accepted - before
        for req in eng.scheduler.running:
            assert not req.draft_token_ids
            if req.num_output_tokens:
                assert req.num_computed_tokens == req.num_tokens - 1
                held = len(req.block_table)  # the next token's block comes when it is scheduled
                assert eng.blocks.blocks_for(req.num_computed_tokens) <= held <= eng.blocks.blocks_for(req.num_tokens)
            for i in range(len(req.block_hashes)):
                block = eng.blocks.blocks[req.block_table[i]]
                assert block.hash is None or block.token_ids == req.token_ids[i * bs:(i + 1) * bs]
    assert rejected > 5
    assert_idle(llm)
    text = render(eng, "demo")  # /metrics back at its idle values
    assert gauge(text, "lowbit:kv_cache_free_blocks") == gauge(text, "lowbit:kv_cache_blocks")
    assert gauge(text, "vllm:num_requests_running") == 0 == gauge(text, "vllm:kv_cache_usage_perc")
    assert gauge(text, "vllm:spec_decode_num_draft_tokens_total") == eng.spec.stats.num_drafts
    first = [tokens_of(deltas[r]) for r in sorted(deltas)]
    hits = eng.blocks.num_prefix_hits
    assert outputs(llm, PROMPTS, sp) == first
    assert eng.blocks.num_prefix_hits > hits
    assert_idle(llm)


@needs_demo
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_demo_preemption_with_drafts(demo, draft_4096, method):
    """A pool too small for every request at once: drafts of preempted requests are dropped
    with their blocks, and the output is still the output without speculation."""
    small = dict(kv_cache_tokens=64, block_size=8, max_num_batched_tokens=64)
    plain = LLM("demo", loaded=demo.loaded, **small)
    kw = {"speculative_model": draft_4096} if method == "draft" else {}
    llm = spec_llm(plain, method, **kw)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert outputs(llm, PROMPTS, sp) == outputs(plain, PROMPTS, sp)
    assert llm.engine.stats.num_preemptions_total > 0 and llm.engine.spec.stats.num_drafts > 0
    assert_idle(llm)


@needs_demo
def test_demo_logprobs_and_stops_with_speculation(demo):
    sp = SamplingParams(temperature=0, max_tokens=20, logprobs=2, stop=[" the"])
    plain = demo.generate(PROMPTS, sp)
    spec = spec_llm(demo, "draft", speculative_model="demo").generate(PROMPTS, sp)
    for a, b in zip(plain, spec):
        assert a.outputs[0].text == b.outputs[0].text and a.outputs[0].token_ids == b.outputs[0].token_ids
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert [x.token_id for x in la] == [x.token_id for x in lb]
        assert all(abs(x.logprob - y.logprob) < 1e-3 for x, y in zip(la, lb))


@needs_demo
def test_demo_seeded_sampling_is_the_same_with_ngram_drafts(demo):
    """Point-mass drafts verify through the sampler's own draw: seeded samples are identical."""
    sp = SamplingParams(temperature=0.8, top_k=50, max_tokens=24, seed=7, repetition_penalty=1.2, ignore_eos=True)
    llm = spec_llm(demo, "ngram")
    assert outputs(llm, PROMPTS, sp) == outputs(demo, PROMPTS, sp)
    assert llm.engine.spec.stats.num_accepted > 0


@needs_demo
def test_demo_token_frequencies_match_at_temperature_1_top_p(demo, demo_perturbed):
    """Temperature 1, top-p 0.9, two drafts sampled from a 4-layer cut of the demo model (most
    of them rejected, some accepted, so acceptance and the residual draw both do work): the 2nd and 3rd generated
    tokens (the verify step's) over N seeded requests, with and without speculation (disjoint
    seeds), are compared by chi-square tests of homogeneity (categories with fewer than 20
    draws in both arms pooled). It fails when a p-value is below 1e-4: a correct engine fails
    it with probability below 2e-4 over the choice of seeds (for the fixed seeds here it is
    deterministic). At this N it catches gross errors only (accepting every draft the top-p
    set allows gives p = 4e-5 at the 3rd token: a failure; subtler errors pass); the rule's
    exactness is pinned by tests/engine/test_acceptance.py on 40,000 draws."""
    n = 200
    prompt = demo.prompts.encode("It was the best of times, it was the worst of times, it was the")
    wide = dict(max_num_seqs=n, max_num_batched_tokens=4 * n)
    plain = LLM("demo", loaded=demo.loaded, kv_cache_tokens=8192, **wide)
    draft = spec_llm(plain, "draft", k=2, speculative_model=demo_perturbed)
    arms = []
    for llm, seed0 in ((plain, 0), (draft, n)):
        reqs = [llm.engine.add_request(prompt, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4,
                                                              seed=seed0 + i, ignore_eos=True))
                for i in range(n)]
        run_all(llm.engine)
        arms.append(torch.tensor([r.output_token_ids for r in reqs]))
    stats = draft.engine.spec.stats
    assert stats.num_drafts >= n and 0.1 < stats.num_accepted / stats.num_drafts < 0.9
    for pos in (1, 2):
        assert homogeneity(arms[0][:, pos], arms[1][:, pos]) > 1e-4
    assert homogeneity(arms[0][:, 0], arms[1][:, 2]) < 1e-4  # power: the first token's distribution differs


def homogeneity(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of the chi-square test that two samples of tokens share one distribution."""
    cats = torch.unique(torch.cat((a, b)))
    ca = torch.stack([(a == c).sum() for c in cats]).double()
    cb = torch.stack([(b == c).sum() for c in cats]).double()
    rare = (ca + cb) < 20
    ca = torch.cat((ca[~rare], ca[rare].sum()[None]))
    cb = torch.cat((cb[~rare], cb[rare].sum()[None]))
    total = ca + cb
    ea, eb = total * a.numel() / (a.numel() + b.numel()), total * b.numel() / (a.numel() + b.numel())
    keep = total > 0
    stat = (((ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb)[keep]).sum()
    return chi2_sf(float(stat), int(keep.sum()) - 1)


# -- a tiny random DeepSeek-V3 with its MTP layer ------------------------------------------
@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    raw = shrink(raw_config("deepseek-ai__DeepSeek-V3"))
    raw.update(num_nextn_predict_layers=1, num_hidden_layers=2, max_position_embeddings=512)
    path = tmp_path_factory.mktemp("v3") / "config.json"
    path.write_text(json.dumps(raw))
    return LLM("v3", random_weights=True, config=str(path), kv_cache_tokens=1024,
               max_num_batched_tokens=32, block_size=8)


def v3_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 40)]


@pytest.mark.parametrize("method", ["mtp", "ngram", "draft"])
def test_v3_greedy_is_the_same_with_speculation(v3, method, tmp_path):
    kw = {"speculative_model": str(random_draft(tmp_path, 256))} if method == "draft" else {}
    llm = spec_llm(v3, method, **kw)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert outputs(llm, v3_prompts(), sp) == plain_outputs(v3, v3_prompts(), sp)
    assert llm.engine.spec.stats.num_drafts > 0
    assert_idle(llm)


def mtp_reference(lm, ids: torch.Tensor) -> torch.Tensor:
    """The MTP layer's output at the last position, computed afresh over the whole sequence."""
    with torch.inference_mode():
        cache = ContiguousKVCache(lm.num_cache_layers, 1, len(ids))
        batch = ForwardBatch.build([len(ids) - 1], [0], [0], cache)
        emb = lm.model.embed_tokens(ids[1:])
        return lm.mtp.predict(lm(ids[:-1], batch), emb, batch)[-1]


@pytest.mark.parametrize("accepting", [False, True])
def test_v3_mtp_drafts_from_the_true_context(v3, accepting):
    """After steps whose chained drafts were rejected (random weights), or accepted (an all-zero
    LM head, which the MTP layer shares: every token and every draft is token 0), the MTP
    layer's cache holds the real context: its output at the last position equals the layer
    run afresh over the whole sequence."""
    loaded = v3.loaded
    if accepting:
        cfg = v3.engine.config
        loaded = LLM("v3", random_weights=True, config=cfg.config, kv_cache_tokens=1024).loaded
        loaded.model.lm_head.weight.zero_()
    llm = spec_llm(v3, "mtp", loaded=loaded)
    eng = llm.engine
    req = eng.add_request(v3_prompts()[2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for _ in range(4):
        eng.step()
    st = eng.spec.stats
    assert st.num_drafts > 0 and (st.num_accepted > 0 if accepting else st.num_accepted < st.num_drafts)
    want = mtp_reference(eng.model, torch.tensor(req.token_ids))
    torch.testing.assert_close(eng.spec.drafter.last[req.request_id][0], want, rtol=1e-3, atol=1e-3)
    run_all(eng)
    assert_idle(llm)


def test_v3_mtp_sampled_drafts_are_seeded(v3):
    """Sampled MTP drafts (temperature > 0, top-p): a seeded request gives the same tokens
    alone and in a batch, run after run."""
    llm = spec_llm(v3, "mtp")
    sp = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=5, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, seed=9, ignore_eos=True)
    prompts = v3_prompts()
    alone = outputs(llm, prompts[2], sp)[0]
    batched = llm.generate(prompts, [other, other, sp])[2].outputs[0].token_ids
    assert alone == batched == outputs(llm, prompts[2], sp)[0]
    assert llm.engine.spec.stats.num_drafts > 0
    assert_idle(llm)


@needs_demo
def test_draft_chains_run_over_static_buffers_whose_device_metadata_is_the_eager_chains(demo):
    """A self-drafting demo at k = 3 takes the static chain (every request wants 3 drafts);
    for each staged chain, the metadata a graph would read (static_batch: positions, slot
    mapping, block tables, lengths computed on the device) equals the eager chain's, and so
    does the catch-up's where it joins the chain (catch_up_batch; its padding writes to the
    scratch block)."""
    from lowbit.engine.speculative import flat_batch

    llm = spec_llm(demo, "draft", speculative_model="demo")
    chain = llm.engine.spec.drafter.chain
    assert chain is not None and not chain.capture_on  # the CPU: eager, no graphs
    seen = []
    original = chain._step

    def spy(b, n, mode, sampling, graph, catch=0):
        if catch:  # the catch-up in the chain: real tokens as the eager catch-up's, padding to scratch
            want = flat_batch(chain.catch_host, chain.kv_cache, chain.device)
            got = chain.catch_up_batch(b, catch)
            counts = [m for _, _, m in chain.catch_host]
            real = torch.tensor([i >= catch - m for m in counts for i in range(catch)])
            assert got.positions.shape == (b * catch,) and torch.equal(got.positions[real], want.positions)
            assert torch.equal(got.slot_mapping[real], want.slot_mapping)
            bs = chain.kv_cache.block_size
            assert bool((got.slot_mapping[~real] // bs == chain.kv_cache.scratch_block).all())
            assert torch.equal(got.seq_lens, want.seq_lens) and bool(real.view(b, catch)[:, -1].all())
            assert torch.equal(got.query_start_dev, torch.arange(b + 1, dtype=torch.int32) * catch)
            assert torch.equal(chain.cids[catch][:b].reshape(-1)[real], torch.as_tensor(chain.catch_ids))
            caught.append((max(counts), catch))
        for j in range(n):
            want = flat_batch([(t, p + j, 1) for t, p in chain.host], chain.kv_cache, chain.device)
            got = chain.static_batch(b, j)
            assert torch.equal(got.positions, want.positions) and torch.equal(got.slot_mapping, want.slot_mapping)
            assert torch.equal(got.seq_lens, want.seq_lens)
            width = want.block_tables.shape[1]
            assert torch.equal(got.block_tables[:, :width], want.block_tables)
            assert bool((got.block_tables[:, width:] == chain.kv_cache.scratch_block).all())
        seen.append((b, n))
        return original(b, n, mode, sampling, graph, catch)

    caught = []
    chain._step = spy
    assert outputs(llm, PROMPTS, GREEDY) == plain_outputs(demo, PROMPTS, GREEDY)
    stats = llm.engine.spec.stats
    # k - 1 = 2 forwards a chain, fewer where max_tokens leaves room for fewer drafts (none at k = 1);
    # the first chain follows the prompt's catch-up (eager), later ones their step's k + 1 = 4 tokens
    assert seen and {n for _, n in seen} <= {0, 1, 2} and seen[0][1] == 2 and stats.num_accepted == stats.num_drafts
    # self-drafting accepts every draft: 3 accepted + 1, in the least width that holds them
    assert caught and max(caught) == (4, 4) and all(m <= w for m, w in caught)
    assert_idle(llm)


@needs_demo
def test_the_catch_up_a_graph_would_replay_drafts_what_the_eager_catch_up_drafts(demo, demo_perturbed, monkeypatch):
    """The fused catch-up as a graph runs it (catch_up_batch's device metadata, front-padded
    rows, the graph-safe prefill attention route in the interpreter, no host length) gives
    draft 0 of the eager catch-up (host-built batch, torch route) on the same staged rows."""
    llm = spec_llm(demo, "draft", speculative_model=demo_perturbed)  # drafts both kept and rejected
    chain = llm.engine.spec.drafter.chain
    original, checked, ptrs = chain.run, [], {}

    def run(b, n, mode, sampling, catch=0):
        if catch:  # a captured graph reads the buffers it was captured with: each width's stay put
            assert ptrs.setdefault(catch, chain.cids[catch].data_ptr()) == chain.cids[catch].data_ptr()
        toks, q = original(b, n, mode, sampling, catch)
        if catch and len(checked) < 2 and max(m for _, _, m in chain.catch_host) < catch:  # padding in a row
            routes.reset_counters()
            with monkeypatch.context() as m:
                m.setenv("LOWBIT_ROUTE_ATTENTION", "triton_paged_prefill")
                again, _ = chain._step(b, 0, mode, sampling, graph=True, catch=catch)
            ran = {c["route"] for c in routes.counters()["route_calls"] if c["op"] == "attention"}
            assert ran == {"triton_paged_prefill"}, ran
            assert torch.equal(again[0], toks[0]), (again, toks)
            checked.append(b)
        return toks, q

    chain.run = run
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], sp)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert checked, "no catch-up shorter than its width was staged"
    assert set(ptrs) == {2, 4}  # drafts kept and rejected: catch-ups of 1-2 and 3-4 tokens


def test_v3_mtp_follow_ups_over_static_buffers_draft_from_the_true_context(v3, monkeypatch):
    """The MTP follow-up as its graph runs it (FollowGraphs: rows padded to their bucket,
    front-padded to the width, the graph-safe latent prefill route in the interpreter, device
    metadata only): the layer's cache and output stay those of the layer run afresh over the
    whole sequence, and greedy output is the one without speculation."""
    llm = spec_llm(v3, "mtp", k=3)
    eng = llm.engine
    graphs = eng.spec.drafter.graphs
    assert graphs is not None and not graphs.capture_on  # the CPU: no graphs
    graphs.capture_on, ran = True, []  # stage as a capture would; run _step where a graph would replay

    def run(b, width):
        got = graphs.batch(b, width)
        bs = graphs.kv_cache.block_size
        real = torch.arange(width) >= width - graphs.count[:b, None]
        assert bool((got.slot_mapping.view(b, width)[~real] // bs == graphs.kv_cache.scratch_block).all())
        with monkeypatch.context() as m:
            m.setenv("LOWBIT_ROUTE_LATENT_ATTENTION", "triton_latent_prefill")
            routes.reset_counters()
            out = graphs._step(b, width)
            used = {c["route"] for c in routes.counters()["route_calls"] if c["op"] == "latent_attention"}
        assert used == {"triton_latent_prefill"}, used
        ran.append((b, width, int(real.sum()) < b * width))
        return out

    graphs.run = run
    req = eng.add_request(v3_prompts()[2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    other = eng.add_request(v3_prompts()[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for _ in range(5):
        eng.step()
    assert ran and {w for _, w, _ in ran} <= {2, 4} and any(pad for _, _, pad in ran)
    for r in (req, other):
        want = mtp_reference(eng.model, torch.tensor(r.token_ids))
        torch.testing.assert_close(eng.spec.drafter.last[r.request_id][0], want, rtol=1e-3, atol=1e-3)
    run_all(eng)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert outputs(llm, v3_prompts(), sp) == plain_outputs(v3, v3_prompts(), sp)
    assert_idle(llm)


@needs_demo
def test_a_draft_models_pool_is_sized_with_the_targets(monkeypatch):
    """The KV pool, sized from memory, counts the draft model's pool (as many tokens as the
    target's, in the draft's layers and dtype) in each token's bytes: on CUDA the draft's
    pool took the memory the target's had claimed (an OOM at its first write). The draft is
    loaded once, before the sizing, and is the drafter's model."""
    from lowbit.engine import paged_cache

    monkeypatch.setattr(paged_cache, "available_ram_bytes", lambda: 4 << 30)
    plain = LLM("demo", max_num_seqs=64, max_model_len=4096)
    spec = LLM("demo", max_num_seqs=64, max_model_len=4096, speculative_method="draft",
               speculative_model="demo-draft", num_speculative_tokens=2)
    eng = spec.engine
    assert eng.spec.drafter.model is eng.draft
    arch, dtype = plain.engine.arch, plain.engine.kv_cache.dtype
    target = paged_cache.kv_bytes_per_token(arch, dtype, plain.engine.model.num_cache_layers)
    draft = paged_cache.kv_bytes_per_token(eng.draft.config, next(eng.draft.parameters()).dtype,
                                           eng.draft.num_cache_layers)
    bs = eng.kv_cache.block_size
    budget = 4 << 30
    assert abs(plain.engine.kv_cache.num_tokens - budget * paged_cache.CPU_POOL_FRACTION // target) < bs
    assert abs(eng.kv_cache.num_tokens - budget * paged_cache.CPU_POOL_FRACTION // (target + draft)) < bs
    assert eng.spec.drafter.kv_cache.num_blocks == eng.kv_cache.num_blocks
