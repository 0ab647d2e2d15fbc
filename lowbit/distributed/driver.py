"""Rank 0 drives, the other ranks follow.

Rank 0 runs the engine (scheduler, sampler, detokenizer, HTTP) as on one GPU; its model is
a `DriverModel` (lowbit.distributed.loading.engine_model wraps rank 0's shard in one). Each
of its methods that runs collectives (the forward, compute_logits, a draft head) or changes
the model (prepare_for_serving) is first broadcast to the workers as a control message,
then run locally; every worker sits in `worker_loop`, runs the same call on its own shard
of the model, and drops the result. So all ranks enter each collective in the same order.

A control message is the method name and its arguments, pickled. Tensors in it travel
by value: small ones inside the message (CPU), large ones (hidden states) over the device
group right after it. A KV cache in it travels by reference: the first time rank 0's
model sees a cache object, the workers build an empty twin of the same geometry, which
the same writes then keep in step (each rank's cache holds only its own heads).
"""

from __future__ import annotations

import io
import logging
import pickle
from collections.abc import Callable

import torch
import torch.distributed as dist

from lowbit.distributed import parallel_state as ps
from lowbit.engine.kv_cache import ContiguousKVCache
from lowbit.engine.paged_cache import PagedKVCache
from lowbit.errors import LowbitError

log = logging.getLogger("lowbit")

MIRRORED = ("forward", "compute_logits", "mtp_forward", "prepare_for_serving")  # DriverModel's calls
INLINE_NUMEL = 1 << 16  # tensors up to this size ride in the control message
STOP = "__stop__"


# rank 0's view of the workers: "loading" (waiting for the handshake), "driven" (in
# worker_loop), "gone" (released or failed), "lost" (one exited while driven); busy: a
# call is in flight
_RUN = {"workers": "loading", "busy": False}
_LOST_HOOKS: list[Callable[[str], None]] = []


def begin_driving() -> None:
    """This process (rank 0) drives the workers from now on."""
    ps.set_driver(True)
    _RUN.update(workers="loading", busy=False)
    _LOST_HOOKS.clear()


def on_workers_lost(hook: Callable[[str], None]) -> None:
    """Call `hook(reason)` (from another thread) if a worker exits while rank 0 drives it."""
    _LOST_HOOKS.append(hook)


def lose_workers(reason: str) -> None:
    """The launcher saw a worker exit early: the world is broken, nothing more is sent."""
    log.error("lost a worker: %s", reason)
    _RUN["workers"] = "lost"
    for hook in list(_LOST_HOOKS):
        hook(reason)


def workers_lost() -> bool:
    return _RUN["workers"] == "lost"


def drive_workers(model: torch.nn.Module) -> torch.nn.Module | DriverModel:
    """Rank 0 of a driven world gets a DriverModel (once every worker has loaded its
    shard), everyone else the model."""
    if not ps.is_driver():
        return model
    errors = _gather_status(None)
    if not workers_lost():  # after a failed handshake every worker exits
        _RUN["workers"] = "gone" if errors else "driven"
    if errors:
        raise LowbitError("a worker could not load its shard: " + "; ".join(errors))
    return DriverModel(model)


def report_loaded(error: str | None) -> bool:
    """A worker's side of the load handshake: True when every rank loaded."""
    return not _gather_status(error)


def _gather_status(error: str | None) -> list[str]:
    out: list = [None] * ps.group_size("world")
    dist.all_gather_object(out, error, group=ps.cpu_group())
    return [e for e in out if e]


def release_workers() -> bool:
    """Rank 0 is done (or failed): let the workers exit. False when a call was cut short
    and the workers are stuck inside it (the launcher then terminates them)."""
    if _RUN["busy"] or workers_lost():
        return False
    if _RUN["workers"] == "driven":
        ps.broadcast_object((STOP, []))
    elif _RUN["workers"] == "loading":  # they wait for the load handshake
        _gather_status("rank 0 stopped before driving")
    _RUN["workers"] = "gone"
    return True


class DriverModel:
    """Stands for the model on rank 0, with the part of a CausalLM's interface the engine
    uses. The MIRRORED calls run on the workers too; the rest reads rank 0's own shard,
    `local`."""

    supports_cuda_graphs = False  # the workers do not capture graphs yet (docs/DISTRIBUTED.md)

    def __init__(self, model: torch.nn.Module) -> None:
        self.local = model
        self._caches: dict[int, tuple[int, object]] = {}  # id(cache) -> (handle, cache)

    # -- mirrored on every rank
    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self._mirror("forward", args, kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._mirror("compute_logits", (hidden,), {})

    def mtp_forward(self, *args, **kwargs) -> torch.Tensor:
        return self._mirror("mtp_forward", args, kwargs)

    def prepare_for_serving(self) -> None:
        self._mirror("prepare_for_serving", (), {})

    # -- rank 0's shard
    @property
    def config(self):
        return self.local.config

    @property
    def num_cache_layers(self) -> int:
        return self.local.num_cache_layers

    def parameters(self, recurse: bool = True):
        return self.local.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.local.named_parameters(*args, **kwargs)

    def modules(self):
        return self.local.modules()

    def named_modules(self, *args, **kwargs):
        return self.local.named_modules(*args, **kwargs)

    def _mirror(self, name: str, args: tuple, kwargs: dict):
        fn = self.local if name == "forward" else getattr(self.local, name)
        big: list[torch.Tensor] = []
        msg = _Packer(self._caches, big).pack((name, args, kwargs))
        ps.broadcast_object((msg, [(tuple(t.shape), t.dtype) for t in big]))
        for t in big:
            ps.broadcast(t.contiguous())
        _RUN["busy"] = True
        out = fn(*args, **kwargs)
        _RUN["busy"] = False
        return out


def worker_loop(model: torch.nn.Module) -> None:
    """Run rank 0's calls on this rank's shard until it says stop."""
    device = ps.current_device()
    caches: dict[int, object] = {}
    with torch.inference_mode():
        while True:
            msg, big_specs = ps.broadcast_object()
            if msg == STOP:
                return
            big = [ps.broadcast(torch.empty(s, dtype=d, device=device)) for s, d in big_specs]
            name, args, kwargs = _Unpacker(msg, caches, big, device).load()
            assert name in MIRRORED, name
            fn = model if name == "forward" else getattr(model, name)
            fn(*args, **kwargs)


# -- pickling with tensors and caches out of band ---------------------------------------------
class _Packer(pickle.Pickler):
    def __init__(self, caches: dict, big: list) -> None:
        self.buf = io.BytesIO()
        super().__init__(self.buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.caches, self.big = caches, big
        self.inline: dict[int, torch.Tensor] = {}  # CPU copies handed out (kept alive): pickled as usual

    def pack(self, obj) -> bytes:
        self.dump(obj)
        return self.buf.getvalue()

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            if id(obj) in self.inline:
                return None
            if obj.numel() > INLINE_NUMEL:
                self.big.append(obj)
                return ("big", len(self.big) - 1)
            cpu = obj.detach().cpu().clone()
            self.inline[id(cpu)] = cpu
            return ("tensor", cpu)
        if _is_cache(obj):
            entry = self.caches.get(id(obj))
            if entry is None or entry[1] is not obj:
                entry = self.caches[id(obj)] = (len(self.caches), obj)
                return ("new_cache", entry[0], _cache_geometry(obj))
            return ("cache", entry[0])
        return None


class _Unpacker(pickle.Unpickler):
    def __init__(self, msg: bytes, caches: dict, big: list, device: torch.device) -> None:
        super().__init__(io.BytesIO(msg))
        self.caches, self.big, self.device = caches, big, device

    def persistent_load(self, pid):
        kind = pid[0]
        if kind == "big":
            return self.big[pid[1]]
        if kind == "tensor":
            return pid[1].to(self.device)
        if kind == "new_cache":
            self.caches[pid[1]] = _twin_cache(pid[2], self.device)
        return self.caches[pid[1]]


def _is_cache(obj) -> bool:
    return isinstance(obj, (PagedKVCache, ContiguousKVCache))


def _cache_geometry(cache: PagedKVCache | ContiguousKVCache) -> tuple:
    if isinstance(cache, PagedKVCache):
        return ("paged", len(cache.k), cache.num_blocks, cache.block_size, cache.dtype)
    return ("contiguous", len(cache.k), cache.num_slots, cache.max_len)


def _twin_cache(geometry: tuple, device: torch.device) -> PagedKVCache | ContiguousKVCache:
    if geometry[0] == "paged":
        return PagedKVCache(*geometry[1:], device)
    return ContiguousKVCache(*geometry[1:])
