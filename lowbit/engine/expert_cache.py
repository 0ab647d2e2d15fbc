"""Expert offload: every MoE layer's experts live in host memory (pinned on CUDA) and a
cache of S slots per layer holds a working set on the device.

Shape legend: T tokens, A top-k, E experts, S slots per MoE layer.
Per MoE layer:
  host[k]     [E, ...]  each per-expert tensor of the layer's stacks (w13 and w2 payloads:
                        codes, scales, table index, offsets; or dense rows; expert biases)
  slots[k]    [S, ...]  the same tensors for the resident experts, on the device
  slot_table  [E] int32 expert id -> slot, -1 when not resident (on the device)
The MoE op never sees the host stacks: the layer's routed ids [T, A] are remapped through
the slot table (a device gather) and the op reads slot stacks built once over `slots`
(lowbit.formats.views' DenseWeight / LutWeight / Fp8View with S leading rows). A LUT
stack's tables (and the decode factors derived from them) are small and stay whole on the
device; the slot copy of an expert's table index keeps pointing into them.

Three ways through a layer:
  fetch      (eager steps) the layer reads its routed ids on the host, admits the missing
             experts through the slot map (lowbit.engine.slot_map, on the device), copies
             them into the evicted slots (on CUDA: the copy kernel of
             lowbit.kernels.expert_copy on a side stream, which the compute stream waits for
             just before the experts run), then runs the experts. With prefetch on, the next
             MoE layer's router is applied to this layer's input (pre-gating) and its likely
             experts are copied while this layer's experts compute. A step needing more
             experts than slots (a prefill) runs them in groups of S, each written in
             float32 and the sum rounded once, as the resident op rounds a token's sum once.
  resolve    (inside a CUDA graph, when the step's experts always fit: rows x top-k <= S)
             no host read: the slot map admits the live rows' experts on the device and the
             copy kernel reads the misses from pinned host memory (zero-copy) before the
             experts run, all in the graph; the replay always stands.
  speculate  (inside a CUDA graph, larger buckets) no host read: a miss is counted in a
             device counter and its entry weighted 0; expert uses are counted per expert.
             The runner reads both after the replay (`graph_check`): a step with a miss is
             rerun eagerly in fetch mode, a step without one updates the policy's recency.
Rows past the step's live rows (a graph bucket's padding, in a replay or its eager rerun)
neither fetch, count nor record their experts; in fetch mode an absent expert of theirs is
masked as the graph form masks it, so the live rows compute what an accepted replay would.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from functools import partial

import torch

from lowbit.engine.expert_policy import DEFAULT_POLICY, write_header, write_step
from lowbit.engine.slot_map import HITS, DeviceSlotMap
from lowbit.errors import LowbitError
from lowbit.formats.base import LutView, QuantizedTensor
from lowbit.formats.hybrid import HybridTensor
from lowbit.formats.views import DenseWeight, Fp8View, LutWeight
from lowbit.kernels.expert_copy import copy_experts, zero_copy_refusal
from lowbit.kernels.moe_op import MoeActivation, moe_experts
from lowbit.kernels.router_op import gate_logits
from lowbit.kernels.weights import resolve
from lowbit.layers.moe import SparseMoE

log = logging.getLogger("lowbit")


def _stack_pieces(w) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], object]:
    """A stacked weight [E, N, K] as per-expert tensors (each [E, ...]), the tensors every
    slot shares, and the kind of kernel-side view to rebuild over slots."""
    r = resolve(w)
    if isinstance(r, DenseWeight):
        return {"w": r.w}, {}, r
    if isinstance(r, Fp8View):
        return {"codes": r.codes, "scales": r.scales}, {}, r
    v = r.view
    pieces = {"codes": v.codes, "scales": v.scales}
    for name in ("table_index", "offsets"):
        if getattr(v, name) is not None:
            pieces[name] = getattr(v, name)
    shared = {"table": v.table}
    if r.alpha_beta is not None:
        shared["alpha_beta"] = r.alpha_beta
    return pieces, shared, r


def _slot_view(kind, t: dict[str, torch.Tensor], shared: dict[str, torch.Tensor]):
    """The kernel-side stack [S, N, K] over the slot tensors `t`."""
    if isinstance(kind, DenseWeight):
        return DenseWeight(t["w"])
    if isinstance(kind, Fp8View):
        return Fp8View(t["codes"], t["scales"], kind.scale_kind, kind.block_rows, kind.block_cols)
    v = kind.view
    view = LutView(t["codes"], v.bits, v.block_size, shared["table"], t.get("table_index"), t["scales"],
                   v.scale_kind, v.global_scale, t.get("offsets"))
    return LutWeight(view, kind.decode, shared.get("alpha_beta"))


class PinnedArena:
    """Pinned host memory for the expert stacks, handed out as views of a few large chunks.

    torch's pinned allocator rounds every allocation up to a power of two (a 604 MB stack takes
    1 GiB), which at Qwen3-235B-A22B's 92 GB of nf3 experts would ask for about 160 GB. Chunks
    here are powers of two themselves (at least CHUNK bytes), so the rounding costs nothing, and
    each tensor goes to the first chunk with room, ALIGN-aligned: the waste is the chunks' unused
    tails. Chunks live as long as any view of them (torch's refcounting)."""

    CHUNK = 1 << 30
    ALIGN = 512

    def __init__(self, pin: bool, alloc=None) -> None:
        self.pin = pin
        self.alloc = alloc or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        self.chunks: list[list] = []  # [uint8 tensor, bytes used]

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of t: in a pinned chunk when pinning, else a plain CPU tensor."""
        t = t.detach()
        if not self.pin:
            return t.to("cpu")
        if any(t.untyped_storage().data_ptr() == c.untyped_storage().data_ptr() for c, _ in self.chunks):
            return t
        nbytes = t.numel() * t.element_size()
        for entry in self.chunks:
            start = -(-entry[1] // self.ALIGN) * self.ALIGN
            if start + nbytes <= entry[0].numel():
                break
        else:
            size = max(self.CHUNK, 1 << max(nbytes - 1, 0).bit_length())
            entry = [self.alloc(size), 0]
            self.chunks.append(entry)
            start = 0
        entry[1] = start + nbytes
        out = entry[0][start:start + nbytes].view(t.dtype).view(t.shape)
        out.copy_(t.contiguous())
        return out

    @property
    def reserved(self) -> int:
        return sum(c.numel() for c, _ in self.chunks)

    @property
    def used(self) -> int:
        return sum(u for _, u in self.chunks)


def _stacks_to_host(ex, arena: PinnedArena) -> None:
    """The model's expert stacks move to host memory (pinned on CUDA) once; the cache's host
    pieces are views of them, so host memory holds each expert once."""
    for name in ("w13", "w2", "b13", "b2"):
        w = getattr(ex, name)
        if isinstance(w, QuantizedTensor):
            payload = {k: arena.take(t) for k, t in w.payload.items()}
            setattr(ex, name, QuantizedTensor(w.format, w.shape, payload))
        elif w is not None:
            setattr(ex, name, torch.nn.Parameter(arena.take(w), requires_grad=False))


def distinct_slots(sid: torch.Tensor, real: torch.Tensor, num_slots: int) -> torch.Tensor:
    """sid [T, A] with every entry where `real` is False moved to a slot no other entry of its
    row reads: the fused decode kernel takes at most one slot per expert and token (top-k ids
    are distinct), so a masked or missing entry must not repeat one. Needs num_slots >= A."""
    T, A = sid.shape
    taken = torch.zeros(T, num_slots, dtype=torch.int32, device=sid.device)
    taken.scatter_add_(1, sid.clamp(min=0).long(), real.int())  # [T, S] real entries per slot
    free_rank = torch.cumsum((taken == 0).int(), dim=1)  # [T, S] free slots up to s
    k = torch.cumsum((~real).int(), dim=1)  # [T, A] 1-based rank among the row's other entries
    fill = torch.searchsorted(free_rank, k).clamp(max=num_slots - 1)  # the k-th free slot
    return torch.where(real, sid, fill.to(sid.dtype))


@dataclass
class LayerStats:
    hits: int = 0
    misses: int = 0
    bytes_copied: int = 0
    prefetched: int = 0  # experts copied ahead by pre-gating
    prefetch_hits: int = 0  # of those, ones the layer then used before evicting them


class LayerCache:
    """One MoE layer's host stacks, device slots and slot table."""

    def __init__(self, moe: SparseMoE, index: int, device: torch.device, arena: PinnedArena | None = None) -> None:
        ex = moe.experts
        if isinstance(ex.w13, HybridTensor):
            raise LowbitError(f"{ex.prefix}: --expert-offload does not take hybrid expert stacks "
                              "(two formats in one layer); quantize the experts to one format")
        self.moe, self.index, self.device = moe, index, device
        self.num_experts = ex.w13.shape[0]
        self.pin = device.type == "cuda"
        arena = arena or PinnedArena(self.pin)
        _stacks_to_host(ex, arena)
        self.host: dict[str, torch.Tensor] = {}
        self._kinds: dict[str, tuple] = {}
        for name in ("w13", "w2"):
            pieces, shared, kind = _stack_pieces(getattr(ex, name))
            self.host |= {f"{name}.{k}": arena.take(t) for k, t in pieces.items()}
            self._kinds[name] = (kind, list(pieces), {k: t.to(device) for k, t in shared.items()})
        for name in ("b13", "b2"):
            if getattr(ex, name) is not None:
                self.host[name] = arena.take(getattr(ex, name))
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in self.host.values())
        self.stream = None
        self.ready = torch.cuda.Event() if self.pin else None
        # graph-form prefetch (ExpertCache.graph_prefetch): its copies' event, and whether one
        # is queued that this layer must wait for before it admits
        self.prefetch_done = torch.cuda.Event() if self.pin else None
        self.prefetch_queued = False

    def allocate(self, num_slots: int, policy: str, stream) -> None:
        """S = min(num_slots, E) empty slots on the device, the slot table all -1."""
        E, device = self.num_experts, self.device
        self.num_slots = S = min(num_slots, E)
        # at least top-k physical slots, so that a row's masked entries find distinct ones
        P = max(S, self.moe.spec.top_k)
        self.slots = {k: torch.zeros(P, *t.shape[1:], dtype=t.dtype, device=device) for k, t in self.host.items()}
        self.views = {name: _slot_view(kind, {k: self.slots[f"{name}.{k}"] for k in keys}, shared)
                      for name, (kind, keys, shared) in self._kinds.items()}
        self.num_physical = P
        self.map = DeviceSlotMap(S, E, policy, device)
        # the largest graph bucket whose experts always fit (rows x top-k <= S) and whose
        # misses the copy kernel can bring in (it reads pinned host memory here); 0: none
        self.resolve_rows = S // self.moe.spec.top_k if zero_copy_refusal(device) is None else 0
        self.slot_table = self.map.slot_table  # [E] int32 view: expert -> slot, -1
        self.misses_dev = torch.zeros((), dtype=torch.int64, device=device)  # views of the
        self.uses_dev = torch.zeros(E, dtype=torch.int64, device=device)  # cache's counters, set by it
        self.stream = stream
        # the copies a graph-form prefetch makes, in a buffer that outlives the step: the side
        # stream reads it after the admission that wrote it has returned
        self.prefetch_pairs = torch.full((S, 2), -1, dtype=torch.int64, device=device)

    @property
    def owner(self) -> list[int]:
        """slot -> expert (-1: free), read from the device."""
        return self.map.owners()

    @property
    def stats(self) -> LayerStats:
        """The layer's counters, read from the device (telemetry, not inside a step)."""
        c = self.map.stats()
        return LayerStats(c["hits"], c["misses"], (c["misses"] + c["prefetched"]) * self.expert_bytes,
                          c["prefetched"], c["prefetch_hits"])

    def resolves(self, rows: int) -> bool:
        """Whether a graph step of `rows` rows admits its own misses on the device."""
        return rows <= self.resolve_rows

    # -- copies ---------------------------------------------------------------------------
    def admit(self, needed: torch.Tensor | list[int], count: bool = True) -> None:
        """Make the experts of needed ([E] bool, or a list) resident, evicting through the policy: the
        slot map updates on the compute stream, the copies run on the side stream (CUDA),
        which first waits for the queued compute (an evicted slot may still be read)."""
        if isinstance(needed, list):
            needed = self.mask(needed)
        pairs = self.map.admit(needed, count)  # [S, 2]
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            copy_experts(pairs, self.host, self.slots)
            if self.ready is not None:
                self.ready.record()
        if self.stream is not None:
            # pairs was allocated on the compute stream and is read on the side stream: without
            # this, its block goes back to the compute stream's pool when admit returns, and
            # the next allocation there (a prefetch's mask or pairs, queued before this copy
            # runs) overwrites the pairs the copy kernel is about to read
            pairs.record_stream(self.stream)

    def wait_copies(self) -> None:
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)

    def prefetch(self, experts: list[int]) -> None:
        """Pre-gating: copy likely experts now (most likely first), uncounted; at most half
        the slots, so that a wrong guess cannot flush the cache."""
        self.admit(experts[:max(1, self.num_slots // 2)], count=False)

    def mask(self, experts: list[int]) -> torch.Tensor:
        """[E] bool of a host list of experts."""
        m = torch.zeros(self.num_experts, dtype=torch.bool, pin_memory=self.pin)
        m[experts] = True
        return m.to(self.device, non_blocking=True)

    # -- the experts through the slots ----------------------------------------------------
    def run(self, x: torch.Tensor, slot_ids: torch.Tensor, w: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        ex = self.moe.experts
        v13, v2 = self.views["w13"], self.views["w2"]
        e = self.num_experts  # the resident model's E: the same kernels, the same roundings
        if ex.b13 is None and ex.b2 is None and ex.activation == "silu":
            return moe_experts(x, slot_ids, w, v13, v2, num_experts=e, out=out, layer=ex.prefix)
        return moe_experts(x, slot_ids, w, v13, v2, b13=self.slots.get("b13"), b2=self.slots.get("b2"),
                           activation=MoeActivation(ex.activation, ex.limit or 0.0), num_experts=e,
                           out=out, layer=ex.prefix)

    def slot_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.slot_table[ids.long()]  # [T, A] int32, -1 where not resident

    def fetch_forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, live: int,
                      meanwhile=None) -> torch.Tensor:
        """Admit the experts of the first `live` rows (the rest: a bucket's padding), then run.
        `meanwhile()` runs after this layer's copies are queued and before it waits for
        them (the next layer's prefetch). Groups write float32 sums rounded once at the end:
        the resident op sums a token's experts in float32 and rounds once, so a group
        rounded to x.dtype on its own would round twice. With top-2 the two sums are the
        same float32 additions (a masked entry adds an exact zero); with more experts per
        token, ones split across groups add in group order."""
        needed = torch.unique(ids[:live]).tolist()  # host read: eager steps only
        if len(needed) <= self.num_slots:
            self.admit(needed)
            if meanwhile is not None:
                meanwhile()
            self.wait_copies()
            sid = self.slot_ids(ids)  # [T, A]
            if live >= ids.shape[0]:
                return self.run(x, sid, w)
            hit = sid >= 0  # padding rows may route to absent experts: masked as in the graph
            return self.run(x, distinct_slots(sid, hit, self.num_physical), w * hit)
        total = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)  # [T, D]
        part = torch.empty_like(total)
        for i in range(0, len(needed), self.num_slots):  # more experts than slots: in groups
            group = needed[i:i + self.num_slots]
            self.admit(group)
            self.wait_copies()
            mine = torch.isin(ids, torch.tensor(group, dtype=ids.dtype, device=ids.device))  # [T, A]
            sid = distinct_slots(self.slot_ids(ids), mine, self.num_physical)
            total += self.run(x, sid, w * mine, out=part)
        return total.to(x.dtype)

    def speculate_forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The graph form of a step whose experts may not fit the slots: a miss is counted
        and read as slot 0 (graph_check sends the step back). Rows past `live_rows` (a
        bucket's padding) neither miss nor count."""
        sid = self.slot_ids(ids)  # [T, A]
        live = torch.arange(ids.shape[0], device=ids.device)[:, None] < self.live_rows  # [T, 1]
        hit = sid >= 0
        self.misses_dev += (~hit & live).sum()
        self.uses_dev.index_add_(0, ids.reshape(-1).long(), live.expand_as(ids).reshape(-1).long())
        return self.run(x, distinct_slots(sid, hit, self.num_physical), w * hit)

    def resolve_forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, pairs_out: bool = False,
                        ahead=None):
        """The graph form of a step whose experts fit the slots (`resolves`): the step
        admits its live rows' experts on the device and copies its misses from pinned host
        memory itself, on its own stream; no host read, nothing to send back. A prefetch
        queued for this layer is waited for first; `ahead()` (the next layer's graph-form
        prefetch) runs after this layer's copies and before its experts, so that its copies
        overlap them."""
        self.wait_prefetch()
        T, A = ids.shape
        pairs, sid, w = self.map.admit_routed(ids, w, self.live_rows)  # padding rows: weight 0
        pairs = pairs[:min(self.num_slots, T * A)]
        copy_experts(pairs, self.host, self.slots)
        if ahead is not None:
            ahead()
        y = self.run(x, sid, w)
        return (y, pairs) if pairs_out else y

    def prefetch_on_device(self, needed: torch.Tensor) -> None:
        """Graph-form pre-gating: admit the experts of needed [E] bool uncounted (no host read)
        and copy them on the side stream; this layer waits for them before it admits."""
        self.prefetch_pairs.copy_(self.map.admit(needed, count=False))
        if self.stream is None:
            copy_experts(self.prefetch_pairs, self.host, self.slots)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # evicted slots: reads done
        with torch.cuda.stream(self.stream):
            copy_experts(self.prefetch_pairs, self.host, self.slots)
            self.prefetch_done.record()
        self.prefetch_queued = True

    def wait_prefetch(self) -> None:
        if self.prefetch_queued:
            torch.cuda.current_stream(self.device).wait_event(self.prefetch_done)
            self.prefetch_queued = False


@dataclass
class RoutingRecorder:
    """--record-routing: one JSON line per step (lowbit.engine.expert_policy's format)."""

    path: str
    step: int = 0
    ids: dict[int, list] = field(default_factory=dict)  # MoE layer position -> [T][A] ids
    preds: dict[int, list] = field(default_factory=dict)

    def open(self, num_experts: int, top_k: int, moe_layers: list[int]) -> None:
        self.f = open(self.path, "w")
        write_header(self.f, num_experts, top_k, moe_layers)
        self.num_layers = len(moe_layers)

    def flush(self) -> None:
        if self.ids:
            ids = [self.ids.get(i, []) for i in range(self.num_layers)]
            preds = [self.preds.get(i, []) for i in range(self.num_layers)] if self.preds else None
            write_step(self.f, self.step, ids, preds)
            self.f.flush()
            self.step += 1
        self.ids, self.preds = {}, {}

    def close(self) -> None:
        self.flush()
        self.f.close()


def free_device_bytes(config, device: torch.device, kv_reserve_bytes: int) -> int | None:
    """Device bytes --gpu-memory-utilization leaves after what is allocated now (the dense
    weights) and the KV reserve; None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return int(total * config.gpu_memory_utilization - (total - free) - kv_reserve_bytes)


def plan_slots(config, num_layers: int, num_experts: int, bytes_per_expert: int,
               free_bytes: int | None) -> int:
    """Slots per MoE layer: --expert-cache-slots, else --expert-cache-gib divided across
    the layers, else `free_bytes` (the device budget left after the dense weights and the KV
    reserve; None on the CPU, where the device is host memory: every expert stays)."""
    if config.expert_cache_slots is not None:
        return min(config.expert_cache_slots, num_experts)
    per_layer = num_layers * bytes_per_expert
    if config.expert_cache_gib is not None:
        slots = int(config.expert_cache_gib * 2**30 // per_layer)
        what = f"--expert-cache-gib {config.expert_cache_gib}"
    elif free_bytes is None:
        return num_experts
    else:
        slots = int(max(0, free_bytes) // per_layer)
        what = f"--gpu-memory-utilization {config.gpu_memory_utilization}"
    if slots < 1:
        raise LowbitError(f"{what} leaves no room for one expert slot per MoE layer ({num_layers} layers x "
                          f"{bytes_per_expert / 2**20:.1f} MiB per expert); give it more memory or set "
                          "--expert-cache-slots")
    return min(slots, num_experts)


class ExpertCache:
    """The slot caches of every MoE layer, the routing recorder and their counters. It is
    the `expert_hook` of each SparseMoE (lowbit.layers.moe)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, offload: bool,
                 prefetch: bool = True, recorder: RoutingRecorder | None = None,
                 graph_prefetch: bool = False) -> None:
        self.moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
        if not self.moes:
            raise LowbitError(f"{type(model).__name__} has no MoE layer: --expert-offload and "
                              "--record-routing need a mixture-of-experts model")
        self.device, self.prefetch, self.recorder = device, prefetch and offload, recorder
        # pre-gating inside resolve-form graph steps too (MEASURED-NEGATIVE: docs/SERVING.md)
        self.graph_prefetch = graph_prefetch and self.prefetch
        self.position = {id(m): i for i, m in enumerate(self.moes)}
        self.arena = PinnedArena(device.type == "cuda")
        self.layers = [LayerCache(m, i, device, self.arena) for i, m in enumerate(self.moes)] if offload else []
        if self.arena.chunks:
            log.info("expert cache: %.2f GiB of pinned host memory in %d chunks for %.2f GiB of experts",
                     self.arena.reserved / 2**30, len(self.arena.chunks), self.arena.used / 2**30)
        self.force_speculate = False  # tests: the graph path without a graph
        self.graph_steps = self.graph_reruns = 0  # replays accepted / sent back by graph_check
        self.resolve_rows = 0  # set by allocate
        self.num_live = 1 << 62  # the step's real rows, on the host (live_rows: on the device)
        for m in self.moes:
            m.expert_hook = self
        if recorder is not None:
            m0 = self.moes[0]
            recorder.open(m0.gate.out_features, m0.spec.top_k, [i for i, _ in enumerate(self.moes)])

    def allocate(self, num_slots: int, policy: str = DEFAULT_POLICY) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        for layer in self.layers:
            layer.allocate(num_slots, policy, stream)
        # one device tensor of counters, [misses, uses per expert] per layer, read in one copy
        sizes = [1 + c.num_experts for c in self.layers]
        cuda = self.device.type == "cuda"
        self.counters = torch.zeros(sum(sizes), dtype=torch.int64, device=self.device)
        self.counters_host = torch.zeros(sum(sizes), dtype=torch.int64, pin_memory=cuda)
        self.counters_ready = torch.cuda.Event() if cuda else None
        self.live_rows = torch.full((), 1 << 62, dtype=torch.int64, device=self.device)
        off = 0
        for c, n in zip(self.layers, sizes):
            c.misses_dev, c.uses_dev = self.counters[off], self.counters[off + 1:off + n]
            c.live_rows = self.live_rows
            off += n
        # the largest decode bucket every layer resolves: its replays need no graph_check read
        self.resolve_rows = min((c.resolve_rows for c in self.layers), default=0)
        refusal = zero_copy_refusal(self.device) if self.layers else None
        if refusal is not None:
            log.warning("expert cache: decode graphs cannot copy their own misses (%s); a graph step "
                        "with a miss runs again eagerly", refusal)
        if self.layers:
            log.info("expert cache: %d of %d experts per MoE layer on the device (%s), %.1f MiB",
                     self.layers[0].num_slots, self.layers[0].num_experts, policy, self.device_bytes / 2**20)

    @property
    def offload(self) -> bool:
        return bool(self.layers)

    @property
    def device_bytes(self) -> int:
        return sum(layer.num_slots * layer.expert_bytes for layer in self.layers)

    def speculating(self) -> bool:
        """Inside a graph capture or its warm-up (sync debug mode on): no host reads."""
        if self.force_speculate:
            return True
        return self.device.type == "cuda" and (torch.cuda.is_current_stream_capturing()
                                               or torch.cuda.get_sync_debug_mode() != 0)

    def warming_up(self) -> bool:
        """The eager step a graph capture runs first (sync debug mode on, not capturing)."""
        return (self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing()
                and torch.cuda.get_sync_debug_mode() != 0)

    def __call__(self, moe: SparseMoE, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        i = self.position[id(moe)]
        layer = self.layers[i] if self.layers else None
        if layer is not None and self.speculating():
            if not layer.resolves(ids.shape[0]):
                return layer.speculate_forward(x, ids, w)
            ahead = self._graph_prefetch(i, x, ids.shape[0])
            if not self.warming_up():
                return layer.resolve_forward(x, ids, w, ahead=ahead)
            # the eager step before a capture computes the step the replay then runs: its
            # admissions are put back, so that the replay makes them once; the slots it
            # copied into are marked free (their old experts gone), so the map stays true
            # to the slots' contents even if the capture then fails (a prefetch it made for
            # the next layer stays: its map and slots agree)
            state = layer.map.state()
            y, pairs = layer.resolve_forward(x, ids, w, pairs_out=True, ahead=ahead)
            layer.map.load(state)
            layer.map.free(pairs[:, 1])
            return y
        live = min(self.num_live, ids.shape[0])
        guess = self._pregate(i, x[:live]) if (self.prefetch or self.recorder) and i + 1 < len(self.moes) else None
        if self.recorder is not None:
            self.recorder.ids[i] = ids[:live].tolist()
            if guess is not None:
                self.recorder.preds[i] = guess
            if i == len(self.moes) - 1:  # the step's last MoE layer: its line is complete
                self.recorder.flush()
        if layer is None:
            return moe.experts(x, ids, w)
        meanwhile = partial(self.layers[i + 1].prefetch, guess) if self.prefetch and guess is not None else None
        return layer.fetch_forward(x, ids, w, live, meanwhile)

    def _graph_prefetch(self, i: int, x: torch.Tensor, rows: int):
        """The next layer's graph-form prefetch as a callable, or None: graph prefetch on, a
        next layer that resolves these rows, and its guesses (rows x top-k) within half its
        slots, so that a wrong guess cannot flush its cache."""
        if not self.graph_prefetch or i + 1 >= len(self.layers):
            return None
        nxt = self.layers[i + 1]
        if not nxt.resolves(rows) or rows * nxt.moe.spec.top_k > nxt.num_slots // 2:
            return None
        return lambda: nxt.prefetch_on_device(self._pregate_mask(i, x, nxt))

    def _next_top(self, i: int, x: torch.Tensor):
        """The next MoE layer's router applied to this layer's input x [T, D]: its top-k
        (values: gate probabilities [T, k], indices [T, k])."""
        nxt = self.moes[i + 1]
        g = nxt.gate
        w32, b32 = getattr(nxt, "_gate32", None) or (g.weight.float(), None if g.bias is None else g.bias.float())
        return torch.topk(torch.softmax(gate_logits(x, w32, b32), -1), nxt.spec.top_k, -1)

    def _pregate_mask(self, i: int, x: torch.Tensor, nxt: LayerCache) -> torch.Tensor:
        """[E] bool: the next layer's router top-k of this layer's input, live rows only (on the device)."""
        live = torch.arange(x.shape[0], device=x.device)[:, None] < self.live_rows
        return nxt.map.needed_mask(self._next_top(i, x).indices, live)

    def _pregate(self, i: int, x: torch.Tensor) -> list[int]:
        """The next MoE layer's likely experts, from this layer's input through the next
        layer's router (its top-k per token), ranked by summed gate probability."""
        top = self._next_top(i, x)
        mass = torch.zeros(self.moes[i + 1].gate.out_features, device=x.device).index_add_(
            0, top.indices.reshape(-1), top.values.reshape(-1))
        order = torch.argsort(mass, descending=True)
        return order[:int((mass > 0).sum())].tolist()  # host read: eager steps only

    def before_forward(self, batch, input_ids: torch.Tensor) -> None:
        """The runner's hook: the step's real rows, which a padded graph replay (on the
        device) and its eager rerun (on the host) read."""
        if self.layers:
            self.num_live = batch.num_tokens
            self.live_rows.fill_(batch.num_tokens)

    def detach(self) -> None:
        """The MoE layers run their own (host-held) experts again; the trace is closed."""
        for m in self.moes:
            m.expert_hook = None
        if self.recorder is not None:
            self.recorder.close()

    def graph_check(self, rows: int | None = None) -> bool:
        """After a graph replay of `rows` rows (a bucket): False if some layer missed (the
        step must run again eagerly); else the replay's expert uses become hits and policy
        recency. A bucket every layer resolves on the device has nothing to check: no read."""
        if not self.layers:
            return True
        if rows is not None and rows <= self.resolve_rows:
            self.graph_steps += 1
            return True
        # a pinned copy and an event wait, like the runner's token read: no implicit sync
        self.counters_host.copy_(self.counters, non_blocking=self.counters_ready is not None)
        if self.counters_ready is not None:
            self.counters_ready.record()
            self.counters_ready.synchronize()
        counts = self.counters_host.tolist()
        offsets = [0]
        for c in self.layers:
            offsets.append(offsets[-1] + 1 + c.num_experts)
        if any(counts[o] for o in offsets[:-1]):
            self.counters.zero_()
            self.graph_reruns += 1
            return False
        self.graph_steps += 1
        for c in self.layers:
            used = c.uses_dev > 0  # [E]
            c.map.counters[HITS] += used.sum()
            c.map.touch(used)
        self.counters.zero_()
        return True

    # -- telemetry -------------------------------------------------------------------------
    def totals(self) -> dict:
        st = [c.stats for c in self.layers]
        return {"hits": sum(s.hits for s in st), "misses": sum(s.misses for s in st),
                "bytes_copied": sum(s.bytes_copied for s in st),
                "prefetched": sum(s.prefetched for s in st),
                "prefetch_hits": sum(s.prefetch_hits for s in st),
                "graph_steps": self.graph_steps, "graph_reruns": self.graph_reruns,
                "graph_resolve_rows": self.resolve_rows}

    def reset_stats(self) -> None:
        """Forget the counts (the engine's start-up profile forward is not traffic)."""
        for c in self.layers:
            c.map.counters.zero_()
        self.graph_steps = self.graph_reruns = 0

    def layer_hit_rates(self) -> list[float]:
        return [round(st.hits / max(1, st.hits + st.misses), 4) for st in (c.stats for c in self.layers)]

    def summary(self, tokens: int) -> str:
        """The CLI stats line's part: hit rate, misses and bytes copied per token."""
        t = self.totals()
        rate = t["hits"] / max(1, t["hits"] + t["misses"])
        per = max(1, tokens)
        return (f"experts {self.layers[0].num_slots}/{self.layers[0].num_experts} per layer: hit {rate:.1%}, "
                f"{t['misses'] / per:.1f} misses/tok, {t['bytes_copied'] / per / 2**20:.2f} MiB/tok")
