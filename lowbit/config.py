"""EngineConfig: every engine setting in one dataclass. CLI flags are generated from its
fields (`max_model_len` -> `--max-model-len`), named as vLLM names them. Fields marked
`server` (host, port, auth, limits) only become flags of `lowbit serve`."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from lowbit.errors import LowbitError

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
SPECULATIVE_METHODS = ("ngram", "draft", "mtp")
DEFAULT_NUM_SPECULATIVE_TOKENS = 3
MAX_NUM_SPECULATIVE_TOKENS = 16


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


def _server_opt(default, help: str, **kw):
    return _opt(default, help, server=True, **kw)


@dataclass
class EngineConfig:
    model: str = "demo"
    dtype: str = _opt("auto", "compute dtype: auto (bf16 on GPU, float32 on CPU), bfloat16, float16, float32")
    device: str | None = _opt(None, "cpu or cuda[:N]; default: cuda when present")
    max_model_len: int | None = _opt(None, "context length; default: the model's max_position_embeddings")
    random_weights: bool = _opt(False, "build the model from --config with seeded random weights (no checkpoint)")
    config: str | None = _opt(None, "config.json giving the shape for --random-weights")
    tokenizer: str | None = _opt(None, "tokenizer directory (default: the model directory)")
    quantization: str | None = _opt(None, "quantize weights while loading to this format (nvfp4, mxfp4, "
                                          "fp8, int4, nf4, ...; see docs/FORMATS.md)")
    # scheduling and KV cache
    max_num_seqs: int = _opt(256, "most requests running at once (at most --max-num-batched-tokens)")
    max_num_batched_tokens: int | None = _opt(
        None, f"most tokens computed per step (prefill is chunked to fit); default {DEFAULT_MAX_NUM_BATCHED_TOKENS}")
    block_size: int = _opt(16, "tokens per KV cache block")
    gpu_memory_utilization: float = _opt(0.9, "share of GPU memory for weights, activations and KV cache")
    kv_cache_dtype: str = _opt("auto", "KV cache storage: auto (the compute dtype), bfloat16, float16, fp8",
                               choices=["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3"])
    kv_cache_tokens: int | None = _opt(
        None, "KV pool size in tokens (default: from --gpu-memory-utilization on CUDA, 10%% of free RAM on CPU)")
    num_gpu_blocks_override: int | None = _opt(None, "KV pool size in blocks; wins over --kv-cache-tokens")
    enable_prefix_caching: bool = _opt(True, "reuse KV blocks of shared prompt prefixes")
    enforce_eager: bool = _opt(False, "never capture CUDA graphs")
    prefill_graphs: bool = _opt(True, "capture prefill and mixed steps in CUDA graphs too, one per (token, "
                                      "sequence) bucket at its first step (off: they run eagerly, "
                                      "launch-bound; decode graphs stay on)")
    cuda_graph_capture: str = _opt(
        "auto", "when CUDA graphs are captured: start (every decode bucket and up to 96 prefill buckets, in "
                "greedy and the default request's sampler mode, before the engine is ready, as vLLM does: no request pays for a capture), "
                "lazy (each bucket at its first step: a faster start, but the first step of each new shape "
                "waits for its capture); auto: start for lowbit serve, lazy elsewhere",
        choices=["auto", "start", "lazy"])
    async_scheduling: bool = _opt(True, "schedule and launch step N+1 while the device runs step N, then read "
                                        "step N's tokens (off: each step waits for its tokens before the next "
                                        "is scheduled); steps that cannot overlap run synchronously")
    cpu_threads: int = _opt(0, "CPU device: intra-op threads; 0 = auto (1 for models whose layer "
                               "matmuls are under 2**20 multiply-adds per token, else torch's default)")
    # speculative decoding (docs/SERVING.md, Speculative decoding)
    speculative_method: str | None = _opt(
        None, "draft tokens with: ngram (prompt lookup, no model), draft (--speculative-model), "
              "mtp (the checkpoint's MTP layer); every step verifies them losslessly",
        choices=list(SPECULATIVE_METHODS))
    num_speculative_tokens: int | None = _opt(None, "draft tokens per step (default 3 with a method)")
    speculative_model: str | None = _opt(None, "draft model (same tokenizer) for --speculative-method draft")
    speculative_adaptive: bool = _opt(False, "choose k per batch size as it serves, at most "
                                             "--num-speculative-tokens, 0 when drafting does not pay, from "
                                             "measured step times and accept rates (the cost model)")
    # bench only (`lowbit bench latency --spec-synthetic-accept P`), never a flag of generate or serve
    speculative_synthetic_accept: float | None = _opt(
        None, "accept each draft with probability P, whatever the target says (emitted text is not the "
              "model's)", cli=False)
    router_zipf: float | None = _opt(None, "with --random-weights: bias every MoE router toward Zipf(S) expert "
                                           "popularity over a seeded per-layer ranking (synthetic routing for "
                                           "expert-cache measurements; docs/SERVING.md)")
    # expert offload (docs/SERVING.md, Expert offload)
    expert_offload: bool = _opt(False, "keep MoE experts in host memory and a cache of them on the device")
    expert_cache_slots: int | None = _opt(None, "with --expert-offload: device slots per MoE layer (default: "
                                                "from --expert-cache-gib, else from --gpu-memory-utilization)")
    expert_cache_gib: float | None = _opt(None, "with --expert-offload: device GiB for expert slots, all MoE layers")
    expert_cache_policy: str = _opt("hot-lru", "with --expert-offload: eviction policy",
                                    choices=["hot-lru", "lru", "lfu"])
    expert_prefetch: bool = _opt(True, "with --expert-offload: copy the next layer's likely experts early "
                                       "(its router applied to this layer's input)")
    expert_prefetch_graphs: bool = _opt(False, "with --expert-offload and prefetch: decode graph steps that copy "
                                               "their own misses also copy the next layer's likely experts, on a "
                                               "side stream while this layer's experts run (MEASURED-NEGATIVE: "
                                               "0.61x C1 decode on an H100, docs/SERVING.md)")
    record_routing: str | None = _opt(None, "write each step's routed expert ids to FILE (JSON lines) for "
                                            "`lowbit bench expert-cache`; steps run eagerly")
    # parallelism across the GPUs of a host (docs/DISTRIBUTED.md); processes = lcm(TP, EP)
    tensor_parallel_size: int = _opt(1, "GPUs that split attention heads, dense MLPs and the vocabulary")
    expert_parallel_size: int = _opt(1, "parts the experts are split into, one per group of GPUs")
    # server
    served_model_name: str | None = _server_opt(None, "model name the API reports and accepts (default: MODEL)")
    host: str = _server_opt("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = _server_opt(8000, "port to listen on")
    api_key: str | None = _server_opt(None, "require 'Authorization: Bearer KEY' on every route but /health")
    max_queued_requests: int = _server_opt(256, "requests allowed to wait beyond --max-num-seqs; more get 429")
    max_request_body_bytes: int = _server_opt(32 << 20, "larger request bodies get 413")
    shutdown_timeout: float = _server_opt(30.0, "seconds in-flight requests get to finish after SIGTERM")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",),
                     server: bool = False) -> None:
        for f in dataclasses.fields(cls):
            if f.name in skip or (f.metadata.get("server") and not server) or not f.metadata.get("cli", True):
                continue
            flag = "--" + f.name.replace("_", "-")
            help_ = f.metadata.get("help")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
                continue
            typ = int if "int" in str(f.type) else (float if "float" in str(f.type) else str)
            parser.add_argument(flag, type=typ, default=f.default, help=help_,
                                choices=f.metadata.get("choices"))

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    def llm_kwargs(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        positive = ("max_num_seqs", "block_size", "max_queued_requests", "max_request_body_bytes")
        for name in positive + ("max_model_len", "max_num_batched_tokens", "kv_cache_tokens",
                                "num_gpu_blocks_override"):
            v = getattr(self, name)
            if (v is not None or name in positive) and (not isinstance(v, int) or v < 1):
                raise LowbitError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
        if not isinstance(self.cpu_threads, int) or self.cpu_threads < 0:
            raise LowbitError(f"--cpu-threads must be 0 (auto) or a positive integer, got {self.cpu_threads}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise LowbitError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self._validate_speculative()
        self._validate_expert_cache()
        z = self.router_zipf
        if z is not None:
            if not self.random_weights:
                raise LowbitError("--router-zipf biases the router of a random-weight model; a checkpoint "
                                  "routes as it was trained (add --random-weights --config FILE)")
            if not (isinstance(z, (int, float)) and 0 <= z <= 4):
                raise LowbitError(f"--router-zipf must be an exponent in [0, 4], got {z}")
            if self.parallel:
                raise LowbitError("--router-zipf runs on one device; drop --tensor-parallel-size / "
                                  "--expert-parallel-size")

    def _validate_expert_cache(self) -> None:
        slots, gib = self.expert_cache_slots, self.expert_cache_gib
        if (slots is not None or gib is not None) and not self.expert_offload:
            raise LowbitError("--expert-cache-slots and --expert-cache-gib size the cache of --expert-offload; "
                              "add --expert-offload")
        if slots is not None and (not isinstance(slots, int) or slots < 1):
            raise LowbitError(f"--expert-cache-slots must be a positive integer, got {slots}")
        if gib is not None and not gib > 0:
            raise LowbitError(f"--expert-cache-gib must be a positive number of GiB, got {gib}")
        if slots is not None and gib is not None:
            raise LowbitError("give --expert-cache-slots or --expert-cache-gib, not both")
        if self.expert_offload and getattr(self, "speculative_method", None) is not None:
            raise LowbitError("--expert-offload does not run with --speculative-method yet (the verify "
                              "step does not check expert cache misses); drop one of them")
        if self.expert_offload and self.parallel:
            raise LowbitError("--expert-offload runs on one GPU; drop --tensor-parallel-size / "
                              "--expert-parallel-size")

    def _validate_speculative(self) -> None:
        method, k = self.speculative_method, self.num_speculative_tokens
        if method is None:
            if (k is not None or self.speculative_model is not None or self.speculative_adaptive
                    or self.speculative_synthetic_accept is not None):
                raise LowbitError("--num-speculative-tokens, --speculative-model, --speculative-adaptive and "
                                  "--spec-synthetic-accept need --speculative-method (ngram, draft or mtp)")
            return
        if method not in SPECULATIVE_METHODS:
            raise LowbitError(f"--speculative-method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
        if k is not None and (not isinstance(k, int) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS):
            raise LowbitError(f"--num-speculative-tokens must be in 1..{MAX_NUM_SPECULATIVE_TOKENS}, got {k}")
        if (method == "draft") != (self.speculative_model is not None):
            raise LowbitError("--speculative-method draft takes --speculative-model DIR (and only it does)")
        p = self.speculative_synthetic_accept
        if p is not None and not (isinstance(p, (int, float)) and 0 <= p <= 1):
            raise LowbitError(f"--spec-synthetic-accept must be a probability in [0, 1], got {p}")

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens per step: 0 without speculative decoding."""
        if self.speculative_method is None:
            return 0
        return self.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS

    @property
    def parallel(self) -> bool:
        """Tensor or expert parallel: one process per GPU, each holding its shard."""
        return self.tensor_parallel_size != 1 or self.expert_parallel_size != 1

    def check_loads_alone(self) -> None:
        """An engine that loads its own model runs in one process: refuse parallel sizes.
        A parallel engine gets its model from lowbit.distributed.engine_model."""
        if self.parallel:
            raise LowbitError(
                f"--tensor-parallel-size {self.tensor_parallel_size} --expert-parallel-size "
                f"{self.expert_parallel_size} needs one process per GPU: `lowbit generate` starts them "
                "itself, as does `lowbit serve`; from Python, run under torchrun and give the engine "
                "lowbit.distributed.engine_model(config) (docs/DISTRIBUTED.md)")

    def resolved(self, max_position_embeddings: int) -> EngineConfig:
        """A copy with the defaults that depend on the model filled in."""
        max_len = self.max_model_len or max_position_embeddings
        tokens = self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        # a running request needs at least one token of every step's budget to make progress
        seqs = min(self.max_num_seqs, tokens)
        return dataclasses.replace(self, max_model_len=max_len, max_num_batched_tokens=tokens,
                                   max_num_seqs=seqs)
