"""`lowbit bench latency --spec METHOD`: speculative decoding against the same run without it.

Two engines share one loaded model: the plain one, and one with the speculative flags
(--spec / --speculative-method, --num-speculative-tokens, --speculative-model). Each tgN
cell decodes N tokens greedily after a fixed text prompt (random token ids when the model
has no tokenizer: then only a draft that is the model itself is accepted), one sequence, the
two engines interleaved repeat by repeat so drift hits both alike. Reported: tok/s of each,
the speedup (ratio of means), the mean accepted length (tokens per verify step: accepted
drafts + 1), the accept rate per draft position, and whether the greedy tokens were the
same (speculation is lossless; a difference is a bug, or a near-tie broken differently by
the verify step's batch shape).
Synthetic (--spec-synthetic-accept P): each draft is accepted with probability P given the
ones before it were, whatever the model says, and every verify step carries k drafts
(lowbit.engine.speculative): the speedup is what verify steps cost at that acceptance, for
random-weight shapes where real acceptance means nothing. The record says `synthetic`,
the rate and the expected accepted length 1 + P + ... + P^k; tokens are not compared.
With --speculative-adaptive the speculative arm's engine chooses k itself (at most
--num-speculative-tokens; lowbit.engine.draft_length) over the whole run, warm-up included:
the record keeps its choices (`k_history`) and the k of each batch bucket after each cell.
Verify cost (the cost model's input): the target's forward and logits over T = 1, 2, 4, 8
new tokens of one sequence after the prompt, replayed from a CUDA graph on CUDA (eagerly on
the CPU, or where the capture fails: the row's `how` says), median of the repeats, and its
ratio to T = 1 (a plain decode step).
Step profiles (CUDA): eight B = 1 decode steps of each arm under the torch profiler
(lowbit.bench.step_profile): kernels per step, GPU busy time, wall-clock per step and
tokens per step, so a verify step's cost splits into GPU time and host time.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time

import torch

from lowbit import LLM, SamplingParams
from lowbit.bench.latency import _sync, graph_status, prefill_graph_status, progress
from lowbit.bench.record import md_table
from lowbit.bench.stats import mean_sd
from lowbit.bench.step_profile import format_profile, profile_decode
from lowbit.config import EngineConfig
from lowbit.distributed import engine_model
from lowbit.engine.draft_length import choose_draft_length, expected_rates
from lowbit.engine.speculative import SpecStats, flat_batch

VERIFY_TOKENS = (1, 2, 4, 8)  # T of the verify-cost cells (B = 1): T - 1 drafts

PROMPT = ("The history of the printing press begins with the carved wooden blocks that monks and "
          "merchants used to stamp patterns on cloth and paper. A printer would ink the block, press "
          "a sheet against it, and lift the sheet away with the image transferred. The press itself "
          "came later, when a screw press of the kind used for olives and grapes was turned to the "
          "work of pressing paper against type. The type was cast in metal, one letter to a piece, ")


def _decode(llm: LLM, prompt: list[int], n: int) -> tuple[float, list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=n + 1, ignore_eos=True)
    out = llm.generate([prompt], sp)[0]
    return out.metrics["decode_s"], out.outputs[0].token_ids


def _prompt(llm: LLM, text: str, room: int) -> list[int]:
    """The text's tokens (random ids without a tokenizer), cut to leave `room` tokens."""
    if llm.prompts is not None:
        ids = llm.prompts.encode(text)
    else:
        rng = random.Random(0)
        ids = [rng.randrange(llm.config.vocab_size) for _ in range(64)]
    return ids[:max(1, llm.max_model_len - room)]


def measure(cfg: EngineConfig, gen: list[int], repeats: int, text: str = PROMPT) -> dict:
    """Time tgN cells with and without speculation; return the record."""
    if not (cfg.kv_cache_tokens or cfg.num_gpu_blocks_override):
        cfg = dataclasses.replace(cfg, kv_cache_tokens=4096 + 2 * max(gen))
    plain_cfg = dataclasses.replace(cfg, speculative_method=None, num_speculative_tokens=None,
                                    speculative_model=None, speculative_synthetic_accept=None,
                                    speculative_adaptive=False)
    t0 = time.perf_counter()
    progress(f"loading {cfg.config if cfg.random_weights else cfg.model} ...")
    plain = LLM(**plain_cfg.llm_kwargs(), loaded=engine_model(plain_cfg))
    spec = LLM(**cfg.llm_kwargs(), loaded=plain.loaded)
    _sync(plain.device)
    progress(f"ready; {graph_status(plain.engine)}", t0)
    prompt = _prompt(plain, text, max(max(gen) + 2 + cfg.num_draft_tokens, max(VERIFY_TOKENS) + 2))
    synthetic = cfg.speculative_synthetic_accept
    # warm-up: first calls allocate, compile and capture graphs. Greedy runs repeat, so two
    # runs of the longest cell capture every graph the timed runs replay (draft chains and
    # catch-ups of each k and width, down to the last tokens' shorter k); the second meets
    # the prompt's prefix in the cache, as the timed runs do, and so its shorter prefill.
    # Synthetic verdicts differ run to run, and with them the verify sizes near the end (k
    # shrinks with the room left): the spec arm also decodes 1..k tokens short of the cell.
    # A timed repeat that still captures a graph is counted in its cell (`captures`).
    for _ in range(2):
        _decode(plain, prompt, max(gen))
    for short in range(cfg.num_draft_tokens + 1) if synthetic is not None else (0, 0):
        _decode(spec, prompt, max(gen) - short)
    for _ in range(WARM_QUIET if synthetic is not None else 0):  # until a run captures nothing
        before = _captured(spec)
        _decode(spec, prompt, max(gen))
        if _captured(spec) == before:
            break
    cells = []
    for n in gen:
        spec.engine.spec.stats = SpecStats()
        times: dict[str, list[float]] = {"plain": [], "spec": []}
        same, captures = True, []
        for r in range(repeats):
            t_plain, want = _decode(plain, prompt, n)
            before = _captured(spec)
            t_spec, got = _decode(spec, prompt, n)
            captures.append(_captured(spec) - before)
            times["plain"].append(t_plain)
            times["spec"].append(t_spec)
            same &= got == want
            progress(f"tg{n} repeat {r + 1}/{repeats}: {n / t_plain:.1f} tok/s plain, {n / t_spec:.1f} spec")
        cells.append(_cell(n, times, same if synthetic is None else None, spec.engine.spec.stats))
        cells[-1]["captures"] = captures
        cells[-1].update(steady_speedup(times, captures, n))
        if spec.engine.spec.adapt is not None:
            cells[-1]["k_now"] = spec.engine.spec.adapt.current()
    verify = verify_costs(plain, prompt, repeats)
    # the same B = 1 decode steps profiled in each arm (CUDA only): a verify step's kernels, GPU
    # busy time and wall-clock beside a plain step's, and the tokens each emits
    profiles = {arm: p for arm, llm in (("plain", plain), ("spec", spec))
                if (p := profile_decode(llm.engine, 1, 8, step_tokens=cfg.num_draft_tokens + 1,
                                        rehearse=arm == "spec")) is not None}
    for c in cells:
        c["cost_model"] = cost_model(c, verify, cfg.speculative_method)
    syn = _synthetic(synthetic, cfg)
    return {"verify": verify, "kind": "latency_spec", "model": cfg.config if cfg.random_weights else cfg.model,
            "weight_format": plain.loaded.weight_format, "device": plain.device,
            "method": cfg.speculative_method, "num_speculative_tokens": cfg.num_draft_tokens,
            "speculative_model": cfg.speculative_model, "prompt_tokens": len(prompt),
            "repeats": repeats, "graphs": graph_status(plain.engine),
            "verify_graph_steps": spec.engine.runner.spec_graph_steps,
            "prefill_graphs": prefill_graph_status(spec.engine), "draft_chains": _chain_status(spec),
            "cells": at_expected_length(cells, syn, cfg.speculative_adaptive),
            "step_profiles": profiles, **syn,
            "adaptive": cfg.speculative_adaptive, **_k_history(spec)}


WARM_QUIET = 4  # synthetic runs: extra warm-up decodes until one captures no graph (at most)


def _captured(llm: LLM) -> int:
    """CUDA graphs the engine holds: decode, prefill (verify steps too) and draft chains or
    MTP follow-ups."""
    runner, drafter = llm.engine.runner, llm.engine.spec.drafter if llm.engine.spec else None
    held = [getattr(runner.graphs, "graphs", None), getattr(runner.prefill_graphs, "graphs", None),
            getattr(getattr(drafter, "chain", None), "graphs", None), getattr(getattr(drafter, "graphs", None), "graphs", None)]
    return sum(len(g) for g in held if g)


def _chain_status(spec: LLM) -> str | None:
    """A draft model's chains (and their catch-ups) or the MTP layer's follow-ups: graph
    replays, captured buckets, or why they run eagerly (None: neither drafter)."""
    drafter = spec.engine.spec.drafter
    chain, follow = getattr(drafter, "chain", None), getattr(drafter, "graphs", None)
    if follow is not None:
        if not follow.capture_on:
            return "MTP follow-ups run eagerly (no CUDA graphs here, or the latent prefill route is not graph-safe)"
        eager = "; ".join(f"{b} rows: {why}" for (b, _), why in follow.eager.items())
        return (f"MTP follow-ups replayed from CUDA graphs: {follow.replays} (captured rows, width: "
                f"{sorted(follow.graphs)})" + (f"; EAGER {eager}" if eager else ""))
    if chain is None:
        return None
    if not chain.capture_on:
        return "draft chains run eagerly (no CUDA graphs here)"
    eager = "; ".join(f"{b} rows: {why}" for (b, *_), why in chain.eager.items())
    catch = ("catch-ups eager: " + drafter.fused_refusal) if drafter.fused_refusal else "catch-ups in the graph"
    return (f"draft chains replayed from CUDA graphs: {chain.replays} (captured rows, forwards, catch-up width: "
            f"{sorted({(k[0], k[1], k[3]) for k in chain.graphs})}; {catch})" + (f"; EAGER {eager}" if eager else ""))


def _k_history(spec: LLM) -> dict:
    adapt = spec.engine.spec.adapt
    if adapt is None:
        return {}
    return {"k_history": adapt.history, "k_now": adapt.current(), "adaptive_steps": adapt.num_steps}


def at_expected_length(cells: list[dict], synthetic: dict, adaptive: bool) -> list[dict]:
    """Synthetic cells at a fixed k: the speedup rescaled from the accepted length the seeded
    draws gave to the one the rate gives on average (a verify step's time does not depend on
    how many of its drafts pass, so tokens a second scale with tokens a step). A short run's
    draws can sit well off the mean; this is the figure to compare across runs."""
    want = synthetic.get("synthetic_expected_accepted_length")
    for c in cells:
        if want and not adaptive and c.get("mean_accepted_length"):
            c["speedup_at_expected_length"] = c["speedup"] * want / c["mean_accepted_length"]
    return cells


def _synthetic(p: float | None, cfg: EngineConfig) -> dict:
    if p is None:
        return {"synthetic": False, "outputs_compared": True}
    k = cfg.num_draft_tokens
    return {"synthetic": True, "outputs_compared": False, "synthetic_accept_rate": p,
            "synthetic_expected_accepted_length": 1 + sum(p ** j for j in range(1, k + 1)),
            "synthetic_note": "SYNTHETIC: drafts accepted with probability P each (given the ones before), "
                              "whatever the model says; the emitted tokens are not the model's and are not "
                              "compared" + ("; random weights, whose real acceptance would mean nothing"
                                            if cfg.random_weights else "")}


def _forward_runner(llm: LLM, ids: torch.Tensor, batch) -> tuple:
    """(a callable that runs the target's forward + logits over ids and returns the logits,
    how it runs). On CUDA the forward is captured once in a CUDA graph and replayed, as the
    engine's verify steps are (an eager forward of a large model is launch-bound: it times
    the host, not the verify); a forward that cannot be captured runs eagerly, and the
    reason goes in the record."""
    eng, dev = llm.engine, torch.device(llm.device)

    def forward():
        return eng.model.compute_logits(eng.model(ids, batch))

    if dev.type != "cuda":
        return forward, "eager"
    try:
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            forward()  # first calls allocate and pick their routes outside the capture
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward()

        def replay():
            graph.replay()
            return out  # the graph's static output, rewritten by each replay
        return replay, "graph"
    except Exception as e:  # noqa: BLE001 - whatever stops the capture, the eager forward still times
        torch.cuda.synchronize(dev)
        return forward, f"eager (capture failed: {str(e).splitlines()[0][:160]})"


@torch.inference_mode()
def verify_costs(llm: LLM, prompt: list[int], repeats: int) -> list[dict]:
    """Seconds of the target's forward + logits over T new tokens after `prompt` (B = 1),
    replayed from a CUDA graph on CUDA (`_forward_runner`)."""
    eng, most = llm.engine, max(VERIFY_TOKENS)
    req = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=most + 1, ignore_eos=True))
    while not req.num_output_tokens:
        eng.step()
    eng.blocks.append_slot(req, req.num_tokens + most)  # the slots T tokens write (freed with the request)
    rows = []
    for t in VERIFY_TOKENS:
        ids = torch.as_tensor(req.token_ids[-1:] * t, device=eng.device)
        batch = flat_batch([(req.block_table, req.num_tokens - 1, t)], eng.kv_cache, eng.device)
        run, how = _forward_runner(llm, ids, batch)
        samples = []
        for _ in range(repeats + 1):  # the first is a warm-up
            _sync(llm.device)
            t0 = time.perf_counter()
            run()
            _sync(llm.device)
            samples.append(time.perf_counter() - t0)
        rows.append({"T": t, "s": statistics.median(samples[1:]), "samples_s": samples[1:], "how": how})
    eng.abort(req.request_id)
    eng.step()  # hands out the abort's delta; the pool is idle again
    for r in rows:
        r["ratio"] = r["s"] / rows[0]["s"]
    return rows


def cost_model(cell: dict, verify: list[dict], method: str) -> dict:
    """What the cost model picks from this run's measurements: the draft time per token is 0
    for ngram, else estimated as the spec arm's time per verify step beyond the verify itself."""
    verify_s = {r["T"]: r["s"] for r in verify}
    k = len(cell["accept_rate_per_position"])
    draft_s = 0.0
    if method != "ngram" and k and cell["verify_steps"]:
        per_step = sum(cell["samples_s"]["spec"]) / cell["verify_steps"]
        draft_s = max(0.0, per_step - verify_s.get(k + 1, max(verify_s.values()))) / k
    rates = expected_rates(cell["accept_rate_per_position"], verify_s, draft_s)
    return {"draft_s_per_token": draft_s, "expected_tok_s": rates,
            "k": choose_draft_length(cell["accept_rate_per_position"], verify_s, draft_s)}


def steady_speedup(times: dict[str, list[float]], captures: list[int], n: int) -> dict:
    """The speedup over the repeats whose spec run captured no graph (capture time is not
    decode time), or {} when every repeat captured or none did."""
    quiet = [i for i, c in enumerate(captures) if not c]
    if not quiet or len(quiet) == len(captures):
        return {}
    plain = statistics.mean(n / times["plain"][i] for i in quiet)
    spec = statistics.mean(n / times["spec"][i] for i in quiet)
    return {"steady_repeats": quiet, "steady_speedup": spec / plain}


def _cell(n: int, times: dict[str, list[float]], same: bool, stats: SpecStats) -> dict:
    rates = {arm: mean_sd([n / t for t in ts]) for arm, ts in times.items()}
    return {"test": f"tg{n}", "n": n, "tok_s_plain": rates["plain"], "tok_s_spec": rates["spec"],
            "speedup": rates["spec"][0] / rates["plain"][0], "same_tokens": same,  # None: not compared
            "samples_s": times, **stats.as_dict()}


HEADERS = ["model", "method", "k", "test", "plain t/s", "spec t/s", "speedup", "accepted len",
           "accept rate per position", "same tokens"]


def table_rows(rec: dict) -> list[list[str]]:
    model = str(rec["model"]).rstrip("/").split("/")[-1].removesuffix(".json")
    method = rec["method"]
    if rec.get("synthetic"):
        method += f" (SYNTHETIC accept {rec['synthetic_accept_rate']:g})"
    rows = []
    for c in rec["cells"]:
        per_pos = " ".join(f"{a:.2f}" for a in c["accept_rate_per_position"])
        same = {True: "yes", False: "NO", None: "not compared"}[c["same_tokens"]]
        k = rec["num_speculative_tokens"]
        if rec.get("adaptive"):
            now = " ".join(f"B{b}:{v}" for b, v in c["k_now"].items()) or "warming up"
            k = f"auto <= {k}, now {now}"
        rows.append([model, method, k, c["test"],
                     f"{c['tok_s_plain'][0]:.2f} ± {c['tok_s_plain'][1]:.2f}",
                     f"{c['tok_s_spec'][0]:.2f} ± {c['tok_s_spec'][1]:.2f}", f"{c['speedup']:.2f}x",
                     f"{c['mean_accepted_length']:.2f}", per_pos or "-", same])
    return rows


def summary_md(rec: dict) -> str:
    foot = (f"{rec['device']}, {rec['weight_format']}, {rec['prompt_tokens']}-token prompt, batch 1, "
            f"greedy; {rec['repeats']} interleaved repeats, mean ± sd; {rec['graphs']}")
    verify = md_table(["T (verify tokens, B = 1)", "ms", "x decode step", "forward"],
                      [[r["T"], f"{1e3 * r['s']:.2f}", f"{r['ratio']:.2f}", r.get("how", "eager")]
                       for r in rec.get("verify", [])])
    picks = "; ".join(f"{c['test']}: k = {c['cost_model']['k']}" for c in rec["cells"] if "cost_model" in c)
    for c in rec["cells"]:
        if any(c.get("captures", [])):
            foot += (f"  \nWARNING {c['test']}: timed speculative repeats captured CUDA graphs "
                     f"({c['captures']} by repeat): those repeats include capture time")
            if "steady_speedup" in c:
                foot += (f"; over the {len(c['steady_repeats'])} that captured none: "
                         f"{c['steady_speedup']:.2f}x")
    for c in rec["cells"]:
        if "speedup_at_expected_length" in c:
            foot += (f"  \n{c['test']}: {c['speedup_at_expected_length']:.2f}x at the expected accepted length "
                     f"({rec['synthetic_expected_accepted_length']:.2f}; these draws gave "
                     f"{c['mean_accepted_length']:.2f}, {c['speedup']:.2f}x)")
    foot += f"  \ncost model's choice from the bench's measurements: {picks}"
    if rec.get("adaptive"):
        changes = ", ".join(f"step {h['step']} B{h['batch_bucket']}: k = {h['k']}" for h in rec["k_history"])
        foot += (f"  \nk chosen by the engine (--speculative-adaptive, from its own step times, "
                 f"{rec['adaptive_steps']} steps): {changes or 'still warming up'}")
    if "verify_graph_steps" in rec:
        foot += (f"  \nverify steps replayed from prefill graphs (mode hidden): {rec['verify_graph_steps']}; "
                 f"{rec['prefill_graphs']}")
    if rec.get("draft_chains"):
        foot += f"  \n{rec['draft_chains']}"
    for arm, p in rec.get("step_profiles", {}).items():
        lines = format_profile(p).splitlines()
        foot += f"  \n{arm} step profile: {lines[0]}"
        foot += "".join(f"; {line.strip()}" for line in lines[1:] if line.startswith("    host "))
    if rec.get("synthetic"):
        foot = (f"{rec['synthetic_note']}; expected accepted length "
                f"{rec['synthetic_expected_accepted_length']:.2f}  \n" + foot)
    return md_table(HEADERS, table_rows(rec)) + "\n\n" + verify + "\n\n" + foot
