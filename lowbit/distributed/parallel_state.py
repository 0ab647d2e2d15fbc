"""Process groups for tensor (TP) and expert (EP) parallelism, and the collectives the
sharded layers call.

Layout of the W = lcm(tp, ep) ranks (one process per GPU):
  TP groups   consecutive blocks of tp ranks: attention heads, dense MLPs, the vocabulary
              are split inside a block (tp_rank = rank % tp) and replicated across blocks.
  experts     E experts in ep contiguous parts of E/ep; the moe_tp = W/ep consecutive ranks
              that hold one part (ep_rank = rank // moe_tp) split each expert's width I.
  MoE output  every rank holds a distinct piece of each MoE layer, so one all-reduce over
              the world combines it.
Every rank runs every step on the same tokens: activations between layers are replicated.

Collectives are plain torch.distributed calls on device tensors, with no host
synchronisation, so a forward that uses them can be captured in a CUDA graph. Each helper
returns its input untouched when the group has one rank, so a world of 1 costs nothing.
Control messages (what the driver asks the workers to run) go over a gloo group on the CPU.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lowbit.errors import LowbitError

TIMEOUT = datetime.timedelta(minutes=30)  # a rank that does not answer for this long is lost
# the tensor forms of all-gather / reduce-scatter (renamed *_single in newer torch)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    ep: int = 1
    rank: int = 0

    @property
    def world(self) -> int:
        return math.lcm(self.tp, self.ep)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def moe_tp(self) -> int:
        """Ranks that split one part of the experts along their width."""
        return self.world // self.ep

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp

    @classmethod
    def checked(cls, tp: int, ep: int, rank: int = 0, world: int | None = None) -> ParallelLayout:
        if tp < 1 or ep < 1:
            raise LowbitError(f"--tensor-parallel-size ({tp}) and --expert-parallel-size ({ep}) must be >= 1")
        need = math.lcm(tp, ep)
        if world is not None and world != need:
            raise LowbitError(
                f"tensor parallel {tp} x expert parallel {ep} runs on lcm({tp}, {ep}) = {need} processes, "
                f"but WORLD_SIZE is {world}; start {need} processes (one per GPU)")
        return cls(tp, ep, rank)


@dataclass
class _State:
    layout: ParallelLayout
    device: torch.device
    groups: dict  # "tp" | "world" -> ProcessGroup (None: the default group)
    cpu_group: object
    driver: bool = False  # rank 0 drives the workers (lowbit.distributed.driver)


_STATE: _State | None = None


def init_distributed(tp: int = 1, ep: int = 1, device: str | None = None) -> ParallelLayout:
    """Join the process group described by the torchrun environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and build the TP groups. NCCL on CUDA, gloo on the
    CPU. Without WORLD_SIZE this is one process: tp and ep must then be 1. Calling it again
    with another (tp, ep) on the same world rebuilds the groups."""
    global _STATE
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    layout = ParallelLayout.checked(tp, ep, rank, world)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    if world == 1:
        _STATE = _State(layout, dev, {"tp": None, "world": None}, None)
        return layout
    if not dist.is_initialized():
        if dev.type == "cuda":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=TIMEOUT)
    elif dist.get_world_size() != world:
        raise LowbitError(f"the process group has {dist.get_world_size()} ranks, WORLD_SIZE says {world}")
    groups = {"world": None, "tp": None}
    for start in range(0, world, tp):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(start, start + tp)))
        if start <= rank < start + tp:
            groups["tp"] = g
    cpu = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=TIMEOUT)
    _STATE = _State(layout, dev, groups, cpu)
    return layout


def check_launched(tp: int, ep: int) -> None:
    """Refuse to run a TP x EP engine in a process that was not started as one of its ranks."""
    layout = current_layout()
    if layout is None or (layout.tp, layout.ep) != (tp, ep):
        raise LowbitError(
            f"--tensor-parallel-size {tp} --expert-parallel-size {ep} needs one process per GPU: "
            "`lowbit generate` starts them itself, as does `lowbit serve`; other entry points must run under torchrun "
            "and call lowbit.distributed.init_distributed first (docs/DISTRIBUTED.md)")


def destroy_distributed() -> None:
    global _STATE
    _STATE = None
    if dist.is_initialized():
        dist.destroy_process_group()


def current_layout() -> ParallelLayout | None:
    """The layout of this process, or None outside init_distributed."""
    return None if _STATE is None else _STATE.layout


def current_device() -> torch.device:
    return _STATE.device if _STATE is not None else torch.device("cpu")


def set_driver(flag: bool) -> None:
    assert _STATE is not None, "init_distributed first"
    _STATE.driver = flag


def is_driver() -> bool:
    return _STATE is not None and _STATE.driver and _STATE.layout.world > 1


def _group(name: str):
    assert _STATE is not None, "init_distributed first"
    return _STATE.groups[name]


def group_size(name: str) -> int:
    if _STATE is None:
        return 1
    return _STATE.layout.tp if name == "tp" else _STATE.layout.world


# -- collectives on device tensors ---------------------------------------------------------
def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum over the group, in place; returns x."""
    if group_size(group) > 1:
        dist.all_reduce(x, group=_group(group))
    return x


def all_gather(x: torch.Tensor, group: str, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's x (equal shapes) along dim, in rank order."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    _ALL_GATHER(out, x, group=_group(group))
    if dim % x.dim() == 0:
        return out
    return torch.cat(out.chunk(n), dim=dim)


def reduce_scatter(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum over the group, then keep chunk `rank` of dim 0 (x.shape[0] divisible by the size)."""
    n = group_size(group)
    if n == 1:
        return x
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    _REDUCE_SCATTER(out, x.contiguous(), group=_group(group))
    return out


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: str = "world") -> torch.Tensor:
    """Rows send[j] of x (in order) go to rank j; returns the rows received, by source rank."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=_group(group))
    return out


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """x from rank src to every rank of the world, in place."""
    if group_size("world") > 1:
        dist.broadcast(x, src=src)
    return x


# -- control messages ------------------------------------------------------------------------
def cpu_group():
    """The gloo group of the whole world, for control messages (None: the default group)."""
    assert _STATE is not None, "init_distributed first"
    return _STATE.cpu_group


def broadcast_object(obj: object = None, src: int = 0) -> object:
    """A picklable object from rank src to all ranks, over the CPU group."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=cpu_group(), device=torch.device("cpu"))
    return box[0]
