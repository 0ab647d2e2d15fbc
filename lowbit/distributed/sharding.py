"""shard_model: make one rank's part of a model built for one GPU, and load it.

Why in place, after building: the model families stay single-GPU code, and one walk over
module types (attention, gated MLP, MoE block, embedding, lm_head) shards every family.
Run on a model whose parameters are still on the meta device (lowbit's loader builds it
so), it only changes shapes; run on a loaded model, it cuts the loaded weights.

Loading a sharded model, each checkpoint tensor takes one of two paths:
  - dense tensors reach the parameter's weight loader, which `cutting_loader` wraps: it
    cuts the whole tensor (or one expert's piece) to this rank's part first. A family
    loader that re-lays a tensor out (gpt-oss's interleaved gate/up) fills a whole-size
    buffer on the CPU, which is then cut.
  - `shard_stream` filters the (name, tensor) stream before CausalLM.load_weights: the
    tensors of another rank's experts are dropped, this rank's are renamed to local
    expert indices (so load counts stay exact), and QuantizedTensors are cut there, since
    they are assembled without a weight loader.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from lowbit.distributed import parallel_state as ps
from lowbit.distributed.expert_parallel import ParallelMoE
from lowbit.distributed.parallel_state import ParallelLayout
from lowbit.distributed.slicing import ShardSpec, take, take_piece
from lowbit.distributed.tensor_parallel import shard_attention, shard_mlp, shard_vocab
from lowbit.errors import LowbitError
from lowbit.formats.base import QuantizedTensor
from lowbit.layers.loading import check_shape, default_loader, expert_loader
from lowbit.layers.mlp import GatedMLP
from lowbit.layers.moe import SparseMoE

_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def shard_model(model: nn.Module, layout: ParallelLayout) -> nn.Module:
    """Shard `model` in place for `layout` (a world of 1 leaves it as is); returns it."""
    if layout.world == 1:
        return model
    if getattr(model, "parallel_layout", None) is not None:
        raise AssertionError("the model is already sharded")
    tp, r = layout.tp, layout.tp_rank
    mods = list(model.named_modules())
    shared = {id(m.shared_experts) for _, m in mods if isinstance(m, SparseMoE) and m.shared_experts is not None}
    for name, mod in mods:
        if isinstance(mod, SparseMoE):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, ParallelMoE(mod, layout))
        elif tp > 1 and isinstance(mod, GatedMLP) and id(mod) not in shared:
            shard_mlp(mod, r, tp)
        elif tp > 1 and hasattr(mod, "o_proj") and hasattr(mod, "H"):
            shard_attention(mod, r, tp)
    if tp > 1:
        shard_vocab(model, r, tp)
    model.parallel_layout = layout
    return model


def shard_if_parallel(model: nn.Module) -> nn.Module:
    """The loader's hook: shard for the layout of this process, if it has one."""
    layout = ps.current_layout()
    return model if layout is None else shard_model(model, layout)


def cutting_loader(base, spec: ShardSpec):
    """Wrap a weight loader so it takes whole checkpoint tensors and keeps this rank's part.
    A tensor already cut (a QuantizedTensor cut in shard_stream, then dequantized) passes."""
    base = base or default_loader
    plain = base in (default_loader, expert_loader)

    def load(param: torch.Tensor, loaded: torch.Tensor, shard=None, name: str = "") -> None:
        if shard is not None:  # one expert's piece; shard_stream made its index local
            half = shard[1]
            whole, local = _piece_shape(spec.logical, spec, half), _piece_shape(spec.local, spec, half)
            if tuple(loaded.shape) != local or local == whole:
                loaded = take_piece(loaded, spec, half, name)
            base(param, loaded, shard, name)
        elif tuple(loaded.shape) == spec.local and spec.local != spec.logical:
            base(param, loaded, None, name)
        elif plain:
            check_shape(name, spec.logical, tuple(loaded.shape))
            base(param, take(loaded, spec, name), None, name)
        else:  # the family re-lays the tensor out: do that at whole size, then cut
            full = torch.empty(spec.logical, dtype=param.dtype, device=loaded.device)
            base(full, loaded, None, name)
            default_loader(param, take(full, spec, name), None, name)

    return load


def _piece_shape(shape: tuple, spec: ShardSpec, half: int | None) -> tuple:
    """One expert's piece of a stack of `shape`: drop the expert dim, halve the gate/up dim."""
    out = list(shape[1:])
    if half is not None and spec.split is not None and spec.split.halves:
        out[spec.split.dim - 1] //= 2
    elif half is not None:
        out[0] //= 2
    return tuple(out)


def shard_stream(model: nn.Module, stream: Iterable) -> Iterator:
    """The checkpoint stream this rank loads (see the module docstring)."""
    if getattr(model, "parallel_layout", None) is None:
        yield from stream
        return
    params = dict(model.named_parameters())
    for name, tensor in stream:
        target = model.map_name(name)
        spec = None if target is None else getattr(params.get(target[0]), "shard_spec", None)
        if spec is None:
            yield name, tensor
            continue
        pname, shard = target
        if spec.experts is not None and shard is not None:
            first, n = spec.experts
            if not first <= shard[0] < first + n:
                continue  # another rank's expert
            name, shard = _local_expert(model, name, pname, shard, first)
        if isinstance(tensor, QuantizedTensor):
            tensor = take(tensor, spec, name) if shard is None else take_piece(tensor, spec, shard[1], name)
        yield name, tensor


def _local_expert(model: nn.Module, name: str, pname: str, shard: tuple, first: int) -> tuple[str, tuple]:
    e = shard[0]
    local = (e - first, shard[1])
    renamed = _EXPERT_INDEX.sub(f".experts.{e - first}.", name, count=1) if f".experts.{e}." in name else None
    if renamed is None or model.map_name(renamed) != (pname, local):
        raise LowbitError(f"expert parallel loading cannot place {name!r} (expert {e} of {pname}): "
                          "its name does not carry the expert index as '.experts.N.'")
    return renamed, local
