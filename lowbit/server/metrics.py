"""/metrics: the engine's state in the Prometheus text format.

Series vLLM also exports carry vLLM's names, types and `vllm:` prefix (with its labels
`model_name` and `engine`), so dashboards written for vLLM read them unchanged; series
only lowbit has (KV blocks, the startup report, kernel route counters) carry `lowbit:`.
"""

from __future__ import annotations

import importlib

from lowbit.engine.engine import LLMEngine
from lowbit.engine.metrics import Histogram
from lowbit.server.startup import StartupReport


def _escape(v) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}" if labels else ""


class Exposition:
    def __init__(self, model_name: str, prefix: str, **labels) -> None:
        self.base = {"model_name": model_name, **labels}
        self.prefix = prefix
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> None:
        name = f"{self.prefix}:{name}"
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        self.lines += [f"{name}{_labels({**self.base, **lab})} {val}" for lab, val in samples]

    def histogram(self, name: str, help_: str, h: Histogram) -> None:
        name = f"{self.prefix}:{name}"
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        for le, n in h.cumulative():
            self.lines.append(f"{name}_bucket{_labels({**self.base, 'le': le})} {n}")
        self.lines.append(f"{name}_sum{_labels(self.base)} {h.sum}")
        self.lines.append(f"{name}_count{_labels(self.base)} {h.count}")


def render(engine: LLMEngine | None, model_name: str, startup: StartupReport | None = None) -> str:
    vllm, own = Exposition(model_name, "vllm", engine="0"), Exposition(model_name, "lowbit")
    if engine is not None:
        _vllm_metrics(vllm, engine)
        _spec_metrics(vllm, engine)
        _block_metrics(own, engine)
        _graph_metrics(own, engine)
        _draft_length_metrics(own, engine)
        _expert_cache_metrics(own, engine)
    if startup is not None:
        _startup_metrics(own, startup)
    _route_metrics(own)
    return "\n".join(vllm.lines + own.lines) + "\n"


def _vllm_metrics(out: Exposition, engine: LLMEngine) -> None:
    s, blocks = engine.stats, engine.blocks
    out.metric("num_requests_running", "gauge", "Number of requests in model execution batches.",
               [({}, engine.num_running)])
    out.metric("num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               [({}, engine.num_waiting)])
    out.metric("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
               [({}, round(blocks.usage, 6))])
    out.metric("prompt_tokens_total", "counter", "Number of prefill tokens processed.",
               [({}, s.prompt_tokens_total)])
    out.metric("generation_tokens_total", "counter", "Number of generation tokens processed.",
               [({}, s.generation_tokens_total)])
    out.metric("num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
               [({}, s.num_preemptions_total)])
    out.metric("prefix_cache_queries_total", "counter",
               "Prefix cache queries, in terms of number of queried tokens.", [({}, blocks.num_prefix_queries)])
    out.metric("prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
               [({}, blocks.num_prefix_hits)])
    out.metric("request_success_total", "counter", "Count of successfully processed requests.",
               [({"finished_reason": r}, n) for r, n in sorted(s.request_success_total.items())])
    out.histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                  s.time_to_first_token)
    out.histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                  s.inter_token_latency)
    out.histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                  s.e2e_request_latency)


def _spec_metrics(out: Exposition, engine: LLMEngine) -> None:
    spec = getattr(engine, "spec", None)
    if spec is None:
        return
    s = spec.stats
    out.metric("spec_decode_num_drafts_total", "counter", "Verify steps of a sequence with drafts.",
               [({}, s.num_steps)])
    out.metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", [({}, s.num_drafts)])
    out.metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
               [({}, s.num_accepted)])
    out.metric("spec_decode_num_accepted_tokens_per_pos_total", "counter", "Draft tokens accepted per position.",
               [({"position": str(j)}, a) for j, a in enumerate(s.accepted_at)])


def _draft_length_metrics(out: Exposition, engine: LLMEngine) -> None:
    adapt = getattr(getattr(engine, "spec", None), "adapt", None)
    if adapt is None:
        return
    out.metric("spec_decode_draft_length", "gauge",
               "Draft tokens per step the engine runs now, per batch-size bucket (--speculative-adaptive).",
               [({"batch_bucket": str(size)}, k) for size, k in adapt.current().items()])


def _block_metrics(out: Exposition, engine: LLMEngine) -> None:
    blocks = engine.blocks
    out.metric("kv_cache_free_blocks", "gauge", "KV cache blocks free (all of them at idle).",
               [({}, blocks.num_free_blocks)])
    out.metric("kv_cache_blocks", "gauge", "KV cache blocks in the pool.", [({}, blocks.num_total_blocks)])
    out.metric("kv_cache_tokens", "gauge", "Tokens the KV cache pool holds.", [({}, engine.kv_cache.num_tokens)])


def _graph_metrics(out: Exposition, engine: LLMEngine) -> None:
    """CUDA graphs held now (decode and prefill) and the start-up capture's seconds: a count
    that grows between two scrapes means a request waited for a capture."""
    runner = getattr(engine, "runner", None)
    held = [(kind, holder) for kind, holder in (("decode", getattr(runner, "graphs", None)),
                                                ("prefill", getattr(runner, "prefill_graphs", None)))
            if holder is not None]
    if held:
        out.metric("cuda_graphs", "gauge", "CUDA graphs captured so far, by kind.",
                   [({"kind": kind}, len(holder.graphs)) for kind, holder in held])
    cap = getattr(engine, "startup_capture", None)
    if cap is not None:
        out.metric("graph_capture_seconds", "gauge", "Seconds the start-up CUDA graph capture took "
                   "(--cuda-graph-capture start).", [({}, round(cap["seconds"], 3))])


def _expert_cache_metrics(out: Exposition, engine: LLMEngine) -> None:
    cache = getattr(engine, "expert_cache", None)
    if cache is None or not cache.offload:
        return
    t = cache.totals()
    out.metric("expert_cache_hits_total", "counter", "Routed experts a step found resident (per layer and step).",
               [({}, t["hits"])])
    out.metric("expert_cache_misses_total", "counter", "Routed experts a step had to copy to the device first.",
               [({}, t["misses"])])
    out.metric("expert_cache_bytes_copied_total", "counter", "Expert bytes copied host to device (misses and prefetch).",
               [({}, t["bytes_copied"])])
    out.metric("expert_cache_prefetched_total", "counter", "Experts copied ahead by pre-gating.",
               [({}, t["prefetched"])])


def _startup_metrics(out: Exposition, r: StartupReport) -> None:
    out.metric("startup_seconds", "gauge", "Seconds from process start to serving requests.",
               [({}, round(r.seconds, 3))])
    out.metric("peak_memory_bytes", "gauge",
               "Peak memory at startup: torch.cuda.max_memory_allocated on CUDA, process peak RSS on the CPU.",
               [({"device": r.memory_device, "measure": r.memory_measure}, r.peak_memory_bytes)])


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
