"""/metrics: the engine's state in the Prometheus text format, under vLLM's metric names
with the `lowbit:` prefix, plus the kernel route counters when lowbit.kernels is present."""

from __future__ import annotations

import importlib

from lowbit.engine.engine import LLMEngine
from lowbit.engine.metrics import Histogram


def _escape(v) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}" if labels else ""


class Exposition:
    def __init__(self, model_name: str) -> None:
        self.base = {"model_name": model_name}
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> None:
        self.lines += [f"# HELP lowbit:{name} {help_}", f"# TYPE lowbit:{name} {kind}"]
        self.lines += [f"lowbit:{name}{_labels({**self.base, **lab})} {val}" for lab, val in samples]

    def histogram(self, name: str, help_: str, h: Histogram) -> None:
        self.lines += [f"# HELP lowbit:{name} {help_}", f"# TYPE lowbit:{name} histogram"]
        for le, n in h.cumulative():
            self.lines.append(f"lowbit:{name}_bucket{_labels({**self.base, 'le': le})} {n}")
        self.lines.append(f"lowbit:{name}_sum{_labels(self.base)} {h.sum}")
        self.lines.append(f"lowbit:{name}_count{_labels(self.base)} {h.count}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(engine: LLMEngine | None, model_name: str) -> str:
    out = Exposition(model_name)
    if engine is not None:
        _engine_metrics(out, engine)
    _route_metrics(out)
    return out.text()


def _engine_metrics(out: Exposition, engine: LLMEngine) -> None:
    s, blocks = engine.stats, engine.blocks
    out.metric("num_requests_running", "gauge", "Requests in the running batch.", [({}, engine.num_running)])
    out.metric("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", [({}, engine.num_waiting)])
    out.metric("kv_cache_usage_perc", "gauge", "Share of KV cache blocks in use (1 = full).",
               [({}, round(blocks.usage, 6))])
    out.metric("prompt_tokens_total", "counter", "Prompt tokens received.", [({}, s.prompt_tokens_total)])
    out.metric("generation_tokens_total", "counter", "Tokens generated.", [({}, s.generation_tokens_total)])
    out.metric("num_preemptions_total", "counter", "Requests preempted for lack of KV blocks.",
               [({}, s.num_preemptions_total)])
    out.metric("prefix_cache_queries_total", "counter", "Tokens looked up in the prefix cache.",
               [({}, blocks.num_prefix_queries)])
    out.metric("prefix_cache_hits_total", "counter", "Tokens served by the prefix cache.",
               [({}, blocks.num_prefix_hits)])
    out.metric("request_success_total", "counter", "Finished requests by finish reason.",
               [({"finished_reason": r}, n) for r, n in sorted(s.request_success_total.items())])
    out.histogram("time_to_first_token_seconds", "Time from arrival to the first token.", s.time_to_first_token)
    out.histogram("inter_token_latency_seconds", "Time between two tokens of a request.", s.inter_token_latency)
    out.histogram("e2e_request_latency_seconds", "Time from arrival to finish.", s.e2e_request_latency)


def _route_metrics(out: Exposition) -> None:
    """Every list of counts lowbit.kernels.routes.counters() returns, as one counter each."""
    try:
        routes = importlib.import_module("lowbit.kernels.routes")
        tables = routes.counters()
    except (ImportError, AttributeError):
        return
    for name, rows in sorted(tables.items()):
        samples = [({k: v for k, v in row.items() if k != "count"}, row.get("count", 0)) for row in rows]
        out.metric(f"{name}_total", "counter", f"Kernel {name.replace('_', ' ')} by label.", samples)
