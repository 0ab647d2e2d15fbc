"""shard_model: make one rank's part of a model built for one GPU, and load it
(`RankPartition` is that part in the form lowbit.checkpoint.loader.load_model takes).

Why in place, after building: the model families stay single-GPU code, and one walk over
module types (attention, gated MLP, MoE block, embedding, lm_head) shards every family.
Run on a model whose parameters are still on the meta device (lowbit's loader builds it
so), it only changes shapes; run on a loaded model, it cuts the loaded weights.

Loading a sharded model, each checkpoint tensor takes one of two paths:
  - dense tensors reach the parameter's weight loader, which `cutting_loader`
    (lowbit.distributed.tensor_parallel) wraps: it cuts the whole tensor (or one expert's
    piece) to this rank's part first. A family loader that re-lays a tensor out (gpt-oss's
    interleaved gate/up) fills a whole-size buffer on the CPU, which is then cut.
  - `shard_stream` filters the (name, tensor) stream before CausalLM.load_weights: the
    tensors of another rank's experts are dropped, this rank's are renamed to local
    expert indices (so load counts stay exact), and QuantizedTensors are cut there, since
    they are assembled without a weight loader.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from torch import nn

from lowbit.distributed.expert_parallel import ParallelMoE
from lowbit.distributed.parallel_state import ParallelLayout
from lowbit.distributed.slicing import take, take_piece
from lowbit.distributed.tensor_parallel import shard_attention, shard_mlp, shard_vocab
from lowbit.errors import LowbitError
from lowbit.formats.base import QuantizedTensor
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


@dataclass(frozen=True)
class RankPartition:
    """One rank's part of a model, as lowbit.checkpoint.loader.load_model takes a
    `partition`: `shard` cuts the model built on the meta device, `stream` filters the
    checkpoint's (name, tensor) stream to match."""

    layout: ParallelLayout

    def shard(self, model: nn.Module) -> nn.Module:
        return shard_model(model, self.layout)

    def stream(self, model: nn.Module, tensors: Iterable) -> Iterator:
        return shard_stream(model, tensors)


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
