"""`lowbit bench latency`: llama-bench style cells on one sequence, in process.

Cells (D tokens already in the KV cache, the "depth"):
  ppP @ dD   prefill P new tokens (time to first token)  -> P / time        (tok/s)
  tgN @ dD   N decode steps of one token, greedy         -> N / time        (tok/s)
MBU of a tg cell: bytes read per token over the time per token, against the copy
bandwidth measured in the same process. Bytes read per token = non-expert weights (the
embedding counts one row unless tied to the LM head) + top-k/E of the expert weights +
the K/V of every cached token at the cell's mean context (windowed layers: the window).
The depth is computed once per D (untimed) and each cell's request reuses it through the
engine's prefix cache (see Session). Times come back from the engine after the sampled
token reached the host, so no extra device sync is needed.
Progress goes to stderr as the run goes (ready, each warm-up step, each cell's sample),
so a run stopped by a time cap still says where it was; the table prints at the end.
"""

from __future__ import annotations

import dataclasses
import os
import random
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowbit import LLM, SamplingParams
from lowbit.bench.expert_cache import h2d_bandwidth, zero_copy_bandwidth
from lowbit.bench.record import md_table
from lowbit.bench.stats import mean_sd
from lowbit.bench.step_profile import format_profile, profile_decode, profile_prefill
from lowbit.checkpoint.hf import resolve_model_dir
from lowbit.config import EngineConfig
from lowbit.distributed import engine_model
from lowbit.errors import LowbitError
from lowbit.kernels import launch, moe_slots, routes, tc_gemv
from lowbit.models.config import load_config


@dataclass
class Cell:
    kind: str  # "pp" | "tg"
    n: int
    depth: int
    batch: int = 1  # tg: sequences decoding together (each over its own depth + 1 tokens)
    samples: list[float] = field(default_factory=list)  # seconds per repeat
    copied: list[int] = field(default_factory=list)  # expert offload: bytes copied per repeat
    misses: list[int] = field(default_factory=list)  # expert offload: misses per repeat

    @property
    def name(self) -> str:
        return (f"{self.kind}{self.n}" + (f" x{self.batch}" if self.batch > 1 else "")
                + (f" @ d{self.depth}" if self.depth else ""))


def progress(msg: str, t0: float | None = None) -> None:
    """One line on stderr, flushed, with the seconds since t0 when given."""
    tail = f" ({time.perf_counter() - t0:.2f} s)" if t0 is not None else ""
    print(f"[latency] {msg}{tail}", file=sys.stderr, flush=True)


def _timed(msg: str, fn, *args):
    t0 = time.perf_counter()
    progress(f"{msg} ...")
    out = fn(*args)
    progress(f"{msg} done", t0)
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


class Session:
    """The one seam between the cells and the engine: the public LLM API, which runs the
    serving engine. The depth is retained through the engine's prefix cache: a request
    whose first D tokens an earlier request computed computes only the rest, so a ppP cell
    is the prefill time of a request [depth + P new tokens] and a tgN cell the decode time
    of a request [depth + 1 token] generating N + 1 tokens (the first comes from prefill)."""

    def __init__(self, cfg: EngineConfig, temperature: float = 0.0) -> None:
        t0 = time.perf_counter()
        self.temperature = temperature
        progress(f"loading {cfg.config if cfg.random_weights else cfg.model} ...")
        self.llm = LLM(**cfg.llm_kwargs(), loaded=engine_model(cfg))
        _sync(self.llm.device)
        self.time_to_ready_s = time.perf_counter() - t0
        progress(f"ready: model built, weights filled, KV cache set up on {self.llm.device}; "
                 f"{graph_status(self.llm.engine)}", t0)
        self.model, self.config, self.device = self.llm.model, self.llm.config, self.llm.device
        self.depth: list[int] = []
        self._rng = random.Random(0)

    def random_ids(self, n: int) -> list[int]:
        return [self._rng.randrange(self.config.vocab_size) for _ in range(n)]

    def set_depth(self, n: int) -> None:
        self.depth = self.random_ids(n)
        if n:
            self._generate(self.depth, 1)

    def prefill(self, n: int) -> float:
        """Seconds to the first token of [depth + n new tokens]."""
        hits = self._prefix_hits()
        out = self._generate(self.depth + self.random_ids(n), 1)
        self._check_reused(hits)
        return out.metrics["prefill_s"]

    def decode(self, n: int, batch: int = 1) -> float:
        """Seconds for n decode steps after the depth, with `batch` sequences in each step."""
        prompts = [self.depth + self.random_ids(1) for _ in range(batch)]
        out = self._generate(prompts, n + 1)
        assert out.metrics["output_tokens"] == batch * (n + 1), "ignore_eos keeps the length"
        return out.metrics["decode_s"]

    def _generate(self, ids: list[int] | list[list[int]], max_tokens: int):
        sp = SamplingParams(temperature=self.temperature, max_tokens=max_tokens, ignore_eos=True,
                            seed=self._rng.randrange(1 << 31) if self.temperature > 0 else None)
        prompts = ids if ids and isinstance(ids[0], list) else [ids]
        return self.llm.generate(prompts, sp)[0]

    def _prefix_hits(self) -> int | None:
        blocks = getattr(getattr(self.llm, "engine", None), "blocks", None)
        return getattr(blocks, "num_prefix_hits", None)

    def _check_reused(self, before: int | None) -> None:
        after = self._prefix_hits()
        block = getattr(getattr(self.llm, "engine", None), "config", None)
        block = getattr(block, "block_size", 1)
        if before is not None and after - before < len(self.depth) - len(self.depth) % block:
            raise LowbitError(f"the engine recomputed the retained depth ({after - before} of "
                              f"{len(self.depth)} tokens reused); keep --enable-prefix-caching on")

    def kv_bytes(self, context: float) -> float:
        """Bytes of K/V read by one decode step over `context` cached tokens."""
        cache = getattr(getattr(self.llm, "engine", None), "kv_cache", None)
        if cache is None:
            return 0.0
        total = 0.0
        for i in range(self.config.num_layers):
            per_token = sum(t[i].nbytes / t[i].shape[0] for t in
                            (getattr(cache, a, None) for a in ("k", "v", "k_scale", "v_scale"))
                            if t is not None and i < len(t) and t[i] is not None)
            window = self.config.layer_window(i)
            total += per_token * min(context, window or context)
        return total


def async_status(engine) -> str:
    """Whether steps overlapped (step N+1 launched before step N was read back), and why not."""
    off = getattr(engine, "async_off", "no async scheduling in this engine")
    if off is not None:
        return f"async scheduling OFF: {off}"
    sync = ", ".join(f"{n} {why}" for why, n in engine.sync_steps.items())
    return (f"async scheduling on: {engine.num_overlapped_steps} steps overlapped"
            + (f"; synchronous: {sync}" if sync else ""))


def graph_status(engine) -> str:
    """What decode steps run as: graphs (captured per bucket at first use) or eager, and why."""
    runner = engine.runner
    if runner.graphs is None:
        return f"decode CUDA graphs OFF: {runner.graphs_off}"
    eager = runner.graphs.eager
    captured = sorted({b for b, _ in runner.graphs.graphs})
    text = f"decode CUDA graphs on (captured buckets: {captured or 'none yet'})"
    if eager:
        text += "; eager buckets: " + "; ".join(f"{b}: {why}" for (b, _), why in sorted(eager.items(), key=str))
    return text


def prefill_graph_status(engine) -> str:
    """What prefill and mixed steps run as: graphs (per token and sequence bucket) or eager."""
    runner = engine.runner
    graphs = getattr(runner, "prefill_graphs", None)
    if graphs is None:
        return f"prefill CUDA graphs OFF: {getattr(runner, 'prefill_graphs_off', 'not in this engine')}"
    return graphs.status()


def pdl_line(device) -> str:
    """Whether the Triton kernels launch with programmatic dependent launch (lowbit.kernels.launch)."""
    return "programmatic dependent launch " + launch.pdl_status(device)


def slot_fusion_line() -> str:
    """Whether the fused MoE saves its slot launches (lowbit.kernels.moe_slots.slot_fusion)."""
    if moe_slots.slot_fusion():
        return ("MoE slot launches fused: one-launch expert sort, combine summed by the next "
                "RMSNorm")
    return "MoE slot launches NOT fused: LOWBIT_SLOT_FUSION=0 (the two-launch sort and the combine launch)"


def ring_line() -> str | None:
    """Whether the tensor-core gemv's tuned configs run as tuned: LOWBIT_TC_NARROW, then their
    shared-memory ring (lowbit.kernels.tc_gemv.ring_enabled); None when neither applies."""
    narrow = tc_gemv.narrow_mode()
    if narrow:
        return (f"tensor-core gemv NARROW: LOWBIT_TC_NARROW={narrow} (launches of up to 8 rows run "
                f"one-warp programs of 16 rows, not their tuned configs)")
    n = tc_gemv.ring_configs(launch._device(None))
    if not n:
        return None
    if tc_gemv.ring_enabled():
        return f"tensor-core gemv: {n} tuned configs load through the shared-memory ring (RING)"
    return f"tensor-core gemv ring OFF: LOWBIT_TC_RING=0 ({n} tuned configs that ask for it run the register loop)"


def route_summary() -> dict:
    """Which route ran each op (calls per route) and the fallbacks warned about."""
    calls: dict[str, dict[str, int]] = {}
    for row in routes.route_table():
        if row["calls"]:
            calls.setdefault(row["op"], {})[row["route"]] = row["calls"]
    return {"calls": calls, "fallbacks": routes.warned_fallbacks()}


def weight_bytes(model: torch.nn.Module, config) -> dict[str, float]:
    """Bytes a decode step reads from the weights: dense, expert (all E), and active."""
    dense = experts = 0.0
    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        held = {**mod._parameters, **{k: v for k, v in vars(mod).items()
                                      if hasattr(v, "payload") or hasattr(v, "view")}}  # quantized
        for name, t in held.items():
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            full = f"{mod_name}.{name}"
            nbytes = float(t.nbytes)  # a tensor's or a QuantizedTensor's payload bytes
            if "embed_tokens" in full and not config.tie_word_embeddings:
                nbytes /= config.vocab_size  # one row per token
            if ".experts." in full + "." and config.num_experts:
                experts += nbytes
            else:
                dense += nbytes
    frac = config.num_experts_per_tok / config.num_experts if config.num_experts else 0.0
    return {"dense": dense, "experts_all": experts, "active_fraction": frac,
            "active": dense + experts * frac}


def copy_bandwidth(device: str, nbytes: int | None = None, iters: int = 8) -> float:
    """Peak read+write bytes/s of a large device-to-device copy (a memcpy on the CPU);
    the buffers are far larger than any cache (1 GiB on a GPU, 128 MiB on the CPU)."""
    nbytes = nbytes or (2**30 if device.startswith("cuda") else 2**27)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best


def peak_memory(device: str) -> dict[str, int]:
    if device.startswith("cuda"):
        return {"peak_device_bytes": torch.cuda.max_memory_allocated(device),
                "device_bytes": torch.cuda.memory_allocated(device)}
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def cell_context(kind: str, n: int, depth: int) -> int:
    """Tokens of context a cell needs: pp: depth + n in, 1 out; tg: depth + 1 in, n + 1 out."""
    return depth + (n + 1 if kind == "pp" else n + 2)


def context_needed(prompt: list[int], gen: list[int], depths: list[int]) -> int:
    return max(cell_context(k, n, max(depths)) for k, ns in (("pp", prompt), ("tg", gen)) for n in ns)


def usable_depths(depths: list[int], prompt: list[int], gen: list[int], max_len: int,
                  fit: bool) -> list[int]:
    """The depths to run. fit=True (the default depths): those whose every cell fits max_len.
    fit=False (depths the user named): all of them, the cells that do not fit are skipped
    with a warning (`fitting_cells`); an error only when a depth has no cell that fits."""
    if fit:
        depths = [d for d in depths if context_needed(prompt, gen, [d]) <= max_len] or [0]
    shortest = min(cell_context(k, n, 0) for k, ns in (("pp", prompt), ("tg", gen)) for n in ns)
    bad = [d for d in depths if d + shortest > max_len]
    if bad:
        need = context_needed(prompt, gen, [max(bad)])
        raise LowbitError(f"depth {max(bad)} + {max(prompt + gen)} tokens needs a context of {need} "
                          f"but the model allows {max_len}; lower -d/-p/-n or raise --max-model-len")
    return depths


def config_max_len(cfg: EngineConfig) -> int | None:
    """The context the engine will allow, read from the config alone (before loading), or
    None where the config cannot be read here (the check after loading still runs)."""
    if cfg.max_model_len:
        return cfg.max_model_len
    try:
        src = cfg.config if cfg.random_weights else resolve_model_dir(cfg.model)
        return load_config(src).max_position_embeddings
    except (LowbitError, OSError, TypeError, ValueError, KeyError):
        return None


def fitting_cells(row: list[Cell], max_len: int) -> tuple[list[Cell], list[str]]:
    """The cells of one depth whose context (cell_context) fits max_len, and the names of
    those that do not (the caller warns and records them)."""
    fits = [cell_context(c.kind, c.n, c.depth) <= max_len for c in row]
    return [c for c, ok in zip(row, fits) if ok], [c.name for c, ok in zip(row, fits) if not ok]


# switches that the code reads at every call (so a variant's graphs capture them); others,
# LOWBIT_PDL among them, are read once per process and need a run of their own
VARIANT_ENV = ("LOWBIT_DECODE_FOLD", "LOWBIT_SLOT_FUSION", "LOWBIT_TC_RING", "LOWBIT_TC_NARROW",
               launch.OVERLAY_ENV)


@dataclass
class Variant:
    """`--variant LABEL=ITEM,ITEM`: ITEM is OP:ROUTE (the route made the op's first choice
    for the run: DEFAULT status, and the op's DEFAULT routes ahead of it in selection order
    set aside as OPT_IN, so calls it admits take it; `norm_gate:unfused` times a promoted
    route's predecessor) or NAME:VALUE for a switch of VARIANT_ENV
    (LOWBIT_LAUNCH_CONFIGS:<path> times a tuner's launch configs)."""
    label: str
    routes: list[tuple[str, str]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Variant:
        label, sep, items = text.partition("=")
        if not sep or not label or label == "base" or not items:
            raise LowbitError(f"--variant {text!r}: expected LABEL=OP:ROUTE[,NAME:VALUE...] with a "
                              "label other than 'base' (the run without changes)")
        v = cls(label)
        for item in items.split(","):
            key, sep, value = item.partition(":")
            if not sep or not key or not value:
                raise LowbitError(f"--variant {text!r}: item {item!r} is not OP:ROUTE or NAME:VALUE")
            if key.startswith("LOWBIT_"):
                if key not in VARIANT_ENV:
                    raise LowbitError(f"--variant {text!r}: {key} is not read at every call, so graphs "
                                      f"of one process cannot differ in it; variants take {', '.join(VARIANT_ENV)}")
                if key == launch.OVERLAY_ENV:
                    launch.overlay_file(value)  # a bad file fails here, before any model loads
                v.env[key] = value
            else:
                op = routes.ops().get(key)
                if op is None or value not in op.names():
                    known = ", ".join(op.names() if op else sorted(routes.ops()))
                    raise LowbitError(f"--variant {text!r}: no route {key}:{value} (known: {known})")
                v.routes.append((key, value))
        return v

    def items(self) -> list[str]:
        return [f"{o}:{r}" for o, r in self.routes] + [f"{k}:{x}" for k, x in self.env.items()]


class Variants:
    """The run's variants in one process: `apply(label)` sets each route's status and each
    switch as the variant says (the others as the run began) and gives the runner that
    variant's own graph set, so graphs captured under one variant never replay under
    another. Labels: "base" first."""

    def __init__(self, s: Session, variants: list[Variant]) -> None:
        self.runner = s.llm.engine.runner
        self.by_label = {"base": Variant("base"), **{v.label: v for v in variants}}
        if len(self.by_label) != len(variants) + 1:
            raise LowbitError("--variant labels must differ")
        self.labels = list(self.by_label)
        # every route of an op a variant names: the ones ahead of its route are set aside
        self.status = {(o, r.name): r.status for o in {o for v in variants for o, _ in v.routes}
                       for r in routes.ops()[o].routes}
        self.env = {k: os.environ.get(k) for v in variants for k in v.env}
        self.graphs = {"base": (self.runner.graphs, self.runner.prefill_graphs)}

    def apply(self, label: str) -> None:
        for (o, r), status in self.status.items():
            routes.ops()[o].get(r).status = status
        for k, x in self.env.items():
            if x is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = x
        v = self.by_label[label]
        for o, r in v.routes:
            routes.ops()[o].prefer(r)
        os.environ.update(v.env)
        if label not in self.graphs:
            self.graphs[label] = self.runner.fresh_graphs()
        self.runner.use_graphs(self.graphs[label])


def run_cells(s: Session, prompt: list[int], gen: list[int], depths: list[int],
              repeats: int, batches: tuple[int, ...] = (1,),
              skipped: list[str] | None = None, variants: Variants | None = None,
              variant_cells: dict[str, list[Cell]] | None = None) -> list[Cell]:
    """Time every cell that fits the context; the names of those that do not go to skipped.
    With variants, each repeat of a cell runs under every variant in turn (interleaved, so
    drift hits them alike); the base's cells are returned, the others' go to variant_cells."""
    labels = variants.labels if variants is not None else ["base"]
    for label in labels:  # warm-up: first calls allocate, compile, capture graphs
        tag = f" ({label})" if variants is not None else ""
        if variants is not None:
            variants.apply(label)
        for p in sorted(set(prompt)):  # each prompt length's prefill graphs are captured here
            _timed(f"warm-up pp{p}{tag}", s.prefill, p)
        for b in batches:
            _timed(f"warm-up tg2 x{b}{tag}", s.decode, 2, b)
    cells: dict[str, list[Cell]] = {label: [] for label in labels}
    for d in sorted(depths):
        if variants is not None:
            variants.apply("base")  # the retained context is computed once, by the base
        if d:
            _timed(f"depth {d}: prefill of the retained context", s.set_depth, d)
        else:
            s.set_depth(d)
        bs = batches if d == 0 else (1,)  # batched cells at depth 0: a pool of B deep contexts is huge
        row = [Cell("pp", p, d) for p in prompt] + [Cell("tg", n, d, b) for n in gen for b in bs]
        row, left_out = fitting_cells(row, s.llm.max_model_len)
        for name in left_out:
            print(f"WARNING: cell {name} skipped: its context exceeds --max-model-len "
                  f"{s.llm.max_model_len}", file=sys.stderr, flush=True)
        if skipped is not None:
            skipped += left_out
        rows = {label: [Cell(c.kind, c.n, c.depth, c.batch) for c in row] for label in labels}
        for r in range(repeats):
            for i in range(len(row)):
                for label in labels:
                    if variants is not None:
                        variants.apply(label)
                    c = rows[label][i]
                    before = _cache_totals(s)
                    c.samples.append(s.prefill(c.n) if c.kind == "pp" else s.decode(c.n, c.batch))
                    after = _cache_totals(s)
                    if after is not None:
                        c.copied.append(after["bytes_copied"] - before["bytes_copied"])
                        c.misses.append(after["misses"] - before["misses"])
                    tag = f" [{label}]" if variants is not None else ""
                    progress(f"{c.name}{tag} repeat {r + 1}/{repeats}: {c.samples[-1]:.3f} s "
                             f"({c.batch * c.n / c.samples[-1]:.1f} tok/s)")
        for label in labels:
            cells[label] += rows[label]
    if variants is not None:
        variants.apply("base")
        if variant_cells is not None:
            variant_cells.update({label: cells[label] for label in labels[1:]})
    return cells["base"]


def _cache_totals(s: Session) -> dict | None:
    """The expert cache's counters (a device read, between timed calls), or None without offload."""
    cache = getattr(getattr(s.llm, "engine", None), "expert_cache", None)
    return cache.totals() if cache is not None and cache.offload else None


def cell_rows(s: Session, cells: list[Cell], bandwidth: float) -> list[dict]:
    wb = weight_bytes(s.model, s.config)
    rows = []
    for c in cells:
        rates = [c.batch * c.n / t for t in c.samples]  # aggregate over the batch
        mean, sd = mean_sd(rates)
        row = {"test": c.name, "kind": c.kind, "n": c.n, "depth": c.depth, "batch": c.batch,
               "tok_s_mean": mean, "tok_s_sd": sd, "ms_per_tok": 1e3 * c.batch / mean,
               "samples_s": c.samples}
        if c.copied:  # per token the cell produced (a tg cell's one-token prefill included)
            tokens = c.batch * c.n * len(c.copied)
            row.update(expert_copy_bytes_per_token=sum(c.copied) / tokens,
                       expert_misses_per_token=sum(c.misses) / tokens)
        if c.kind == "tg":
            per_step = step_bytes(wb, c.batch) + c.batch * s.kv_bytes(c.depth + 1 + (c.n + 1) / 2)
            steps_s = mean / c.batch
            row.update(bytes_per_step=per_step, gb_s=per_step * steps_s / 1e9,
                       mbu=per_step * steps_s / bandwidth)
        rows.append(row)
    return rows


def add_depth_ratios(rows: list[dict], bandwidth: float) -> list[dict]:
    """Each tg cell at a depth gets its rate over the same cell's at depth 0 (`vs_d0`), and
    the most that ratio can be (`vs_d0_bound`): the depth-0 step plus the extra K/V bytes
    the deeper step reads, at the copy bandwidth. A ratio near its bound means the depth
    costs what its bytes cost; a bound under a target means no kernel can meet it."""
    base = {(r["n"], r["batch"]): r for r in rows if r["kind"] == "tg" and not r["depth"]}
    for r in rows:
        b = base.get((r["n"], r["batch"]))
        if r["kind"] != "tg" or not r["depth"] or b is None or "bytes_per_step" not in r:
            continue
        step0 = r["batch"] / b["tok_s_mean"]  # seconds a step at depth 0
        extra = max(0.0, r["bytes_per_step"] - b["bytes_per_step"])
        r["vs_d0"] = r["tok_s_mean"] / b["tok_s_mean"]
        r["vs_d0_bound"] = step0 / (step0 + extra / bandwidth)
    return rows


def step_bytes(wb: dict, batch: int) -> float:
    """Weight bytes one decode step of `batch` sequences reads: the dense weights once, and
    each expert at most once: the expected share of distinct experts that B tokens, each
    picking k of E uniformly, touch is 1 - (1 - k/E)^B."""
    touched = 1 - (1 - wb["active_fraction"]) ** batch
    return wb["dense"] + wb["experts_all"] * touched


def measure(cfg: EngineConfig, prompt: list[int], gen: list[int], depths: list[int],
            repeats: int, fit_depths: bool = False, batches: tuple[int, ...] = (1,),
            temperature: float = 0.0, variants: list[Variant] | None = None) -> dict:
    """Load, check lengths, time every cell, measure the copy ceiling; return the record.
    fit_depths: drop the depths that do not fit the context instead of refusing.
    variants: the same cells (interleaved) and decode profiles under each variant too, in
    the record's "variants" (one model load for an A/B of routes)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(cfg.device if (cfg.device or "").startswith("cuda") else None)
    if not (cfg.kv_cache_tokens or cfg.num_gpu_blocks_override):
        # a pool sized for the cells, with room for the free blocks the allocator takes before
        # the retained depth's; the rest of the memory stays free for long-context activations
        need = context_needed(prompt, gen, depths)
        need += (max(batches) - 1) * (max(gen) + 2)
        cfg = dataclasses.replace(cfg, kv_cache_tokens=need + max(need // 4, 4096),
                                  max_num_seqs=max(cfg.max_num_seqs, max(batches)))
    if not fit_depths and (max_len := config_max_len(cfg)) is not None:
        usable_depths(depths, prompt, gen, max_len, False)  # refuse before the load, not after it
    s = Session(cfg, temperature)
    depths = usable_depths(depths, prompt, gen, s.llm.max_model_len, fit_depths)
    mem_loaded = peak_memory(s.device)
    skipped: list[str] = []
    switch = Variants(s, variants) if variants else None
    other: dict[str, list[Cell]] = {}
    cells = run_cells(s, prompt, gen, depths, repeats, batches, skipped, switch, other)
    mem = peak_memory(s.device)
    profiles = [p for b in batches if (p := _timed(f"profile of decode steps x{b}", profile_decode,
                                                    s.llm.engine, b)) is not None]
    pre = _timed(f"profile of a {max(prompt)}-token prefill", profile_prefill, s.llm.engine, max(prompt))
    profiles += [pre] if pre is not None else []
    bw = copy_bandwidth(s.device)
    variant_recs = []
    for label, vcells in other.items():
        switch.apply(label)
        vprof = [p for b in batches if (p := _timed(f"profile of decode steps x{b} ({label})", profile_decode,
                                                     s.llm.engine, b)) is not None]
        variant_recs.append({"label": label, "items": switch.by_label[label].items(),
                             "cells": add_depth_ratios(cell_rows(s, vcells, bw), bw), "step_profiles": vprof})
    if switch is not None:
        switch.apply("base")
    return {"kind": "latency", "model": cfg.config if cfg.random_weights else cfg.model,
            "weight_format": s.llm.loaded.weight_format, "device": s.device,
            "dtype": str(next(s.model.parameters()).dtype).removeprefix("torch."),
            "kv_cache_tokens": cfg.kv_cache_tokens, "repeats": repeats, "temperature": temperature,
            "router_zipf": cfg.router_zipf, "time_to_ready_s": s.time_to_ready_s,
            "memory_after_load": mem_loaded, "memory": mem, "copy_bandwidth_Bps": bw,
            "weight_bytes": weight_bytes(s.model, s.config), "cells": add_depth_ratios(cell_rows(s, cells, bw), bw),
            "skipped_cells": skipped,
            "graphs": graph_status(s.llm.engine), "prefill_graphs": prefill_graph_status(s.llm.engine),
            "async": async_status(s.llm.engine), "pdl": pdl_line(s.device),
            "slot_fusion": slot_fusion_line(),
            "tc_ring": ring_line() if str(s.device).startswith("cuda") else None,
            "launch_configs": launch.config_status() if str(s.device).startswith("cuda") else None,
            "routes": route_summary(), "step_profiles": profiles,
            "expert_cache": expert_cache_summary(s.llm.engine), "variants": variant_recs}


def expert_cache_summary(engine) -> dict | None:
    """With --expert-offload: slots, totals over the whole run, and each MoE layer's hit rate."""
    cache = getattr(engine, "expert_cache", None)
    if cache is None or not cache.offload:
        return None
    first = cache.layers[0]
    return {"slots": first.num_slots, "num_experts": first.num_experts, "expert_bytes": first.expert_bytes,
            **cache.totals(), "layer_hit_rates": cache.layer_hit_rates(),
            "h2d_bandwidth_Bps": h2d_bandwidth(str(engine.device)),
            "zero_copy_bandwidth_Bps": zero_copy_bandwidth(str(engine.device), first.expert_bytes),
            "host_bytes": cache.arena.used, "host_reserved_bytes": cache.arena.reserved}


HEADERS = ["model", "format", "dtype", "device", "test", "t/s", "ms/tok", "GB/s", "MBU"]


def table_rows(rec: dict) -> list[list[str]]:
    model = Path(str(rec["model"])).name.removesuffix(".json")
    rows = []
    for c in rec["cells"]:
        gbs = f"{c['gb_s']:.3g}" if "gb_s" in c else "-"
        mbu = f"{100 * c['mbu']:.1f}%" if "mbu" in c else "-"
        device = rec.get("env", {}).get("device", rec["device"]).split(" (")[0]
        rows.append([model, rec["weight_format"], rec["dtype"], device, c["test"],
                     f"{c['tok_s_mean']:.2f} ± {c['tok_s_sd']:.2f}", f"{c['ms_per_tok']:.2f}", gbs, mbu])
    return rows


def summary_md(rec: dict) -> str:
    mem = rec["memory"]
    peak = mem.get("peak_device_bytes", mem.get("peak_rss_bytes", 0))
    foot = (f"ready in {rec['time_to_ready_s']:.1f} s; peak memory {peak / 2**30:.2f} GiB "
            f"({'device' if 'peak_device_bytes' in mem else 'RSS'}); copy bandwidth "
            f"{rec['copy_bandwidth_Bps'] / 1e9:.1f} GB/s; active weight bytes per token "
            f"{rec['weight_bytes']['active'] / 2**20:.1f} MiB; {rec['repeats']} repeats, mean ± sd")
    lines = [foot, rec.get("graphs", ""), rec.get("prefill_graphs", ""), rec.get("async", ""),
             rec.get("pdl", ""), rec.get("slot_fusion", ""), rec.get("tc_ring") or "",
             rec.get("launch_configs") or ""]
    if rec.get("temperature") or rec.get("router_zipf") is not None:
        lines.append(f"tokens sampled at temperature {rec.get('temperature') or 0:g}"
                     + (f"; SYNTHETIC routing: routers biased toward Zipf({rec['router_zipf']:g}) expert "
                        "popularity" if rec.get("router_zipf") is not None else ""))
    ec = rec.get("expert_cache")
    if ec:
        h2d = ec.get("h2d_bandwidth_Bps")
        lines.append(f"expert cache {ec['slots']}/{ec['num_experts']} slots per layer: hits {ec['hits']}, "
                     f"misses {ec['misses']}, {ec['bytes_copied'] / 2**20:.1f} MiB copied"
                     + (f" (pinned H2D {h2d / 1e9:.1f} GB/s)" if h2d else "")
                     + (f" (zero-copy kernel {ec['zero_copy_bandwidth_Bps'] / 1e9:.1f} GB/s)"
                        if ec.get("zero_copy_bandwidth_Bps") else "")
                     + (f"; host {ec['host_bytes'] / 2**30:.2f} GiB in {ec['host_reserved_bytes'] / 2**30:.2f} GiB "
                        "of pinned chunks" if ec.get("host_reserved_bytes") else "")
                     + f"; graph steps {ec['graph_steps']}, reruns {ec['graph_reruns']}, buckets up to "
                     f"{ec['graph_resolve_rows']} rows copy misses in the graph; per-layer hit rates "
                     + " ".join(f"{r:.2f}" for r in ec["layer_hit_rates"]))
        h2d = h2d or ec.get("zero_copy_bandwidth_Bps")
        for c in rec["cells"]:
            per = c.get("expert_copy_bytes_per_token")
            if c["kind"] == "tg" and per:
                bound = f"; copies alone at {h2d / 1e9:.1f} GB/s allow {h2d / per:,.0f} tok/s" if h2d else ""
                lines.append(f"{c['test']}: {per / 2**20:.1f} MiB of experts copied a token "
                             f"({c['expert_misses_per_token']:.1f} misses){bound}")
    lines += [f"{c['test']}: {100 * c['vs_d0']:.1f} % of depth 0; its extra K/V bytes at the copy "
              f"bandwidth allow at most {100 * c['vs_d0_bound']:.1f} %" for c in rec["cells"] if "vs_d0" in c]
    lines += [format_profile(p).splitlines()[0] for p in rec.get("step_profiles", [])]
    fallbacks = rec.get("routes", {}).get("fallbacks", [])
    lines += [f"WARNING reference route on CUDA: {f}" for f in fallbacks]
    for v in rec.get("variants") or []:
        base = {c["test"]: c["tok_s_mean"] for c in rec["cells"]}
        lines.append(f"variant {v['label']} ({', '.join(v['items'])}), interleaved with the base: "
                     + "; ".join(f"{c['test']} {c['tok_s_mean']:.1f} ± {c['tok_s_sd']:.1f} tok/s "
                                 f"({c['tok_s_mean'] / base[c['test']]:.3f}x)" for c in v["cells"]
                                 if base.get(c["test"])))
        lines += [f"  {v['label']}: " + format_profile(p).splitlines()[0] for p in v.get("step_profiles", [])]
    if rec.get("skipped_cells"):
        lines.append("WARNING cells skipped, their context exceeds the model's: "
                     + ", ".join(rec["skipped_cells"]))
    return md_table(HEADERS, table_rows(rec)) + "\n\n" + "  \n".join(x for x in lines if x)
