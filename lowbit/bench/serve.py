"""`lowbit bench serve`: closed-loop streaming load on an OpenAI-compatible server.

For each (context, concurrency) level: N requests, exactly C in flight (C workers, each
sending its next request when the previous one ends). Every prompt is a prefix of
`context` tokens shared by all requests of the level (the retained context a prefix
cache can keep) followed by `input_len` tokens of its own. Prompts are token ids when the
server has /tokenize (ids drawn from the tokenized word list), else random words.
Reported per level: the `vllm bench serve` block (TTFT, TPOT, ITL, E2EL mean / median /
p99), aggregate throughput (all completion tokens over the wall interval of the level)
and the per-user decode rate ((tokens - 1) / (last chunk - first chunk) of each request).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from lowbit.bench.client import Client, RequestResult
from lowbit.bench.stats import distribution

WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city name "
         "team minute idea kid body information back parent face others level office door "
         "health person art war history party result change morning reason research girl "
         "guy moment air teacher force education river garden light small green quiet "
         "open close bring carry follow lead stand learn write read speak run walk").split()


FALLBACK_IDS = range(1000, 3000)  # inside any real vocabulary


@dataclass
class LoadConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "/v1/completions"
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    context: tuple[int, ...] = (0,)
    num_prompts: int | None = None  # per level; default prompts_per_slot * C
    prompts_per_slot: int = 4
    input_len: int = 128
    output_len: int = 128
    payload: str = "deterministic"  # deterministic (greedy) | stochastic (temperature 1)
    ignore_eos: bool = False
    api_key: str | None = None
    seed: int = 0
    warmup: int = 1
    timeout: float | None = None
    time_limit: float | None = None  # seconds for the whole run: no request starts after it

    def prompts_for(self, c: int) -> int:
        return self.num_prompts or self.prompts_per_slot * c


class PromptMaker:
    """Seeded prompts of exact token length (ids mode) or approximate length (words mode)."""

    def __init__(self, seed: int, pool: list[int] | None) -> None:
        self.rng, self.pool = random.Random(seed), pool

    @property
    def ids_mode(self) -> bool:
        return self.pool is not None

    def piece(self, n: int):
        if self.pool is not None:
            return [self.rng.choice(self.pool) for _ in range(n)]
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def join(self, prefix, suffix):
        if self.pool is not None:
            return prefix + suffix
        return f"{prefix} {suffix}" if prefix else suffix


def request_body(cfg: LoadConfig, model: str, prompt, max_tokens: int | None = None) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens or cfg.output_len, "stream": True,
                  "stream_options": {"include_usage": True}}
    if cfg.endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.payload == "deterministic":
        body.update(temperature=0.0, seed=cfg.seed)
    else:
        body.update(temperature=1.0, top_p=1.0)
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


async def _drive(client: Client, cfg: LoadConfig, bodies: list[tuple[dict, int]], c: int,
                 deadline: float) -> tuple[list[RequestResult], float, float]:
    queue = list(reversed(bodies))
    results: list[RequestResult] = []

    async def worker() -> None:
        while queue and time.perf_counter() < deadline:
            body, planned = queue.pop()
            results.append(await client.stream(cfg.endpoint, body, planned))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(c, len(bodies)))))
    return results, t0, time.perf_counter()


def summarize(results: list[RequestResult], duration: float) -> dict:
    duration = max(duration, 1e-9)
    ok = [r for r in results if r.ok]
    n_in = sum(r.input_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    ttft = [r.first - r.send for r in ok]
    tpot = [(r.end - r.first) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:])]
    e2el = [r.end - r.send for r in ok]
    per_user = [(r.output_tokens - 1) / (r.chunks[-1] - r.first) for r in ok
                if r.output_tokens > 1 and r.chunks[-1] > r.first]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration, "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        "aggregate_throughput": n_out / duration,
        "ttft_ms": distribution(ttft, 1e3), "tpot_ms": distribution(tpot, 1e3),
        "itl_ms": distribution(itl, 1e3), "e2el_ms": distribution(e2el, 1e3),
        "per_user_tok_s": distribution(per_user),
        "usage_reported": all(r.completion_tokens is not None for r in ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


async def _drop_refused_extensions(client: Client, cfg: LoadConfig, model: str, log) -> list[str]:
    """`ignore_eos` is a vLLM extension that some servers (transformers serve) refuse with a
    4xx naming it: then run without it, say so, and list it in the record. Token counts
    come from usage either way, so an output that stops at EOS is still counted right."""
    if not cfg.ignore_eos:
        return []
    probe = await client.stream(cfg.endpoint, request_body(cfg, model, "Hello", 2), 2)
    if probe.error.startswith("HTTP 4") and "ignore_eos" in probe.error:
        cfg.ignore_eos = False
        log("the server refuses ignore_eos; running without it (outputs may end at EOS)")
        return ["ignore_eos"]
    return []


async def _prompt_maker(client: Client, cfg: LoadConfig, model: str, log) -> PromptMaker:
    """Token ids from the server's tokenizer when it has /tokenize; else words; else (a
    server without a tokenizer, e.g. random weights) ids from FALLBACK_IDS."""
    chat = cfg.endpoint.endswith("chat/completions")
    text = " ".join(random.Random(cfg.seed).choice(WORDS) for _ in range(2048))
    ids = None if chat else await client.tokenize(text, model)
    candidates = [sorted(set(ids))] if ids else []
    candidates += [None] + ([] if chat else [list(FALLBACK_IDS)])
    for pool in candidates:
        maker = PromptMaker(cfg.seed, pool)
        probe = await client.stream(cfg.endpoint, request_body(cfg, model, maker.piece(8), 2), 8)
        if not probe.error.startswith("HTTP 4"):
            return PromptMaker(cfg.seed, pool)
        log(f"the server refused {'token-id' if pool else 'text'} prompts: {probe.error[:120]}")
    return PromptMaker(cfg.seed, None)


async def run_load(cfg: LoadConfig, log=print) -> dict:
    """Run every level; return the record (without the environment)."""
    client = Client(cfg.base_url, cfg.api_key, cfg.timeout, max_connections=max(cfg.concurrency) + 4)
    try:
        model = cfg.model or (await client.models())[0]
        dropped = await _drop_refused_extensions(client, cfg, model, log)
        maker = await _prompt_maker(client, cfg, model, log)
        before = await client.metrics()
        deadline = time.perf_counter() + (cfg.time_limit or float("inf"))
        levels, skipped = [], []
        for ctx in cfg.context:
            prefix = maker.piece(ctx) if ctx else ([] if maker.ids_mode else "")
            if time.perf_counter() < deadline:
                await _warm(client, cfg, model, maker, prefix, deadline, log)
            for c in cfg.concurrency:
                if time.perf_counter() >= deadline:
                    skipped.append({"concurrency": c, "context": ctx})
                    continue
                levels.append(await _level(client, cfg, model, maker, prefix, ctx, c, deadline, log))
        after = await client.metrics()
        if skipped:
            log(f"time limit reached; skipped levels {skipped}")
    finally:
        await client.close()
    return {"kind": "serve", "base_url": client.base, "model": model, "endpoint": cfg.endpoint,
            "prompt_mode": "ids" if maker.ids_mode else "words", "config": cfg.__dict__,
            "server_startup": server_startup(before), "dropped_fields": dropped,
            "server_metrics": {"before": before, "after": after}, "levels": levels, "skipped": skipped}


STARTUP_SERIES = {"lowbit:startup_seconds": "time_to_ready_s",
                  "lowbit:peak_memory_bytes": "peak_memory_bytes",
                  "lowbit:kv_cache_tokens": "kv_cache_tokens",
                  "lowbit:graph_capture_seconds": "graph_capture_s"}


def server_startup(metrics: dict[str, float] | None) -> dict:
    """What the server reports of its start-up (lowbit's gauges; other servers: nothing):
    time to ready, peak memory (with its measure and device labels), KV pool tokens."""
    out: dict = {}
    for key, value in (metrics or {}).items():
        name, _, labels = key.partition("{")
        if name in STARTUP_SERIES:
            out[STARTUP_SERIES[name]] = value
            if labels:
                out[STARTUP_SERIES[name] + "_labels"] = "{" + labels
    return out


def startup_line(rec: dict) -> str:
    s = rec.get("server_startup") or {}
    if not s:
        return "server start-up: not reported by this server"
    mem = s.get("peak_memory_bytes")
    return ("server start-up: ready in " + (f"{s['time_to_ready_s']:.1f} s" if "time_to_ready_s" in s else "?")
            + ", peak memory " + (f"{mem / 2**30:.2f} GiB {s.get('peak_memory_bytes_labels', '')}" if mem else "?")
            + ", KV pool " + (f"{int(s['kv_cache_tokens'])} tokens" if "kv_cache_tokens" in s else "?")
            + (f", CUDA graphs captured at start in {s['graph_capture_s']:.1f} s" if "graph_capture_s" in s else ""))


async def _warm(client: Client, cfg: LoadConfig, model: str, maker: PromptMaker, prefix,
                deadline: float, log) -> None:
    """Unrecorded rounds with the level's prefix: for each concurrency level, C requests of
    the measured input length with a few output tokens, all in flight together, so that a
    server's first-use work (kernel compiles for the prefill shapes, a CUDA graph per batch
    size) is not timed as the first requests' latency."""
    for _ in range(cfg.warmup):
        for c in cfg.concurrency:
            bodies = [(request_body(cfg, model, maker.join(prefix, maker.piece(cfg.input_len)),
                                    min(cfg.output_len, 4)), cfg.input_len) for _ in range(c)]
            results, _t0, _t1 = await _drive(client, cfg, bodies, c, deadline)
            failed = [r.error for r in results if r.error]
            if failed:
                log(f"warm-up at concurrency {c}: {len(failed)} request(s) failed: {failed[0]}")


async def _level(client: Client, cfg: LoadConfig, model: str, maker: PromptMaker, prefix,
                 ctx: int, c: int, deadline: float, log) -> dict:
    planned = ctx + cfg.input_len  # exact for id prompts, about right for words
    bodies = [(request_body(cfg, model, maker.join(prefix, maker.piece(cfg.input_len))), planned)
              for _ in range(cfg.prompts_for(c))]
    m0 = await client.metrics()
    results, t0, t1 = await _drive(client, cfg, bodies, c, deadline)
    m1 = await client.metrics()
    delta = {k: m1[k] - v for k, v in m0.items() if k in m1 and m1[k] != v} if m0 and m1 else None
    summary = summarize(results, t1 - t0)
    log(format_block(summary, c, ctx))
    return {"concurrency": c, "context": ctx, "num_prompts": len(results), "summary": summary,
            "metrics_delta": delta, "requests": [r.as_dict(t0) for r in results]}


def format_block(s: dict, c: int, ctx: int) -> str:
    w = 44
    line = lambda k, v: f"{k:<{w}}{v}"
    num = lambda x: f"{x:.2f}"
    out = ["{:=^54}".format(" Serving Benchmark Result "),
           line("Maximum request concurrency:", c), line("Retained context (tokens):", ctx),
           line("Successful requests:", s["completed"]), line("Failed requests:", s["failed"]),
           line("Benchmark duration (s):", num(s["duration_s"])),
           line("Total input tokens:", s["total_input_tokens"]),
           line("Total generated tokens:", s["total_output_tokens"]),
           line("Request throughput (req/s):", num(s["request_throughput"])),
           line("Output token throughput (tok/s):", num(s["output_throughput"])),
           line("Total token throughput (tok/s):", num(s["total_token_throughput"]))]
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"),
                              ("e2el_ms", "End-to-end Latency", "E2EL")):
        out.append(f"{title:-^54}")
        for stat in ("mean", "median", "p99"):
            out.append(line(f"{stat.capitalize() if stat != 'p99' else 'P99'} {short} (ms):",
                            num(s[key][stat])))
    u = s["per_user_tok_s"]
    out += ["{:-^54}".format("Decode"),
            line("Aggregate throughput (tok/s):", num(s["aggregate_throughput"])),
            line("Per-user decode rate mean (tok/s):", num(u["mean"])),
            line("Per-user decode rate median (tok/s):", num(u["median"])),
            line("Per-user decode rate min (tok/s):", num(u["min"])), "=" * 54]
    return "\n".join(out)


SUMMARY_HEADERS = ["context", "C", "ok/failed", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
                   "TPOT p50 ms", "ITL p99 ms", "per-user tok/s p50"]


def summary_rows(rec: dict) -> list[list]:
    rows = []
    for lv in rec["levels"]:
        s = lv["summary"]
        rows.append([lv["context"], lv["concurrency"], f"{s['completed']}/{s['failed']}",
                     f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
                     f"{s['ttft_ms']['median']:.1f}", f"{s['ttft_ms']['p99']:.1f}",
                     f"{s['tpot_ms']['median']:.2f}", f"{s['itl_ms']['p99']:.2f}",
                     f"{s['per_user_tok_s']['median']:.1f}"])
    return rows
