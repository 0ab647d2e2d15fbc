"""Tensor parallel layers, made by sharding the modules of a built model in place.

A model family is written once, for one GPU. `shard_model` (lowbit.distributed.sharding)
then swaps its layers for the parallel ones below, keeping every parameter name, so the
checkpoint loader, the quantization policy and the kernels see the same model with
smaller weights. Each new parameter carries a ShardSpec and a weight loader that cuts the
checkpoint tensor to this rank's part (lowbit.distributed.slicing).

Shapes: T tokens, D hidden, N/K a linear layer's out/in features, p = tp ranks.
  column-parallel  W [N/p, K]   y_r = x W_r^T            [T, N/p]  (no communication)
  row-parallel     W [N, K/p]   y = sum_r x_r W_r^T      [T, N]    (all-reduce)
  attention        q heads H/p; kv heads Hkv/p, or 1 copy of head r*Hkv/p when Hkv < p;
                   MLA: q_b/q_proj and kv_b split by heads, q_a and the latent kv_a whole
  gated MLP        gate/up column-parallel on the intermediate dim, down row-parallel
  vocabulary       V padded to a multiple of p, rows [r*V/p, (r+1)*V/p) per rank;
                   embedding: masked lookup + all-reduce; logits: all-gather, then [:, :V]
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.distributed import parallel_state as ps
from lowbit.distributed.slicing import ShardSpec, Split, take, take_piece
from lowbit.errors import LowbitError
from lowbit.kernels.linear_op import linear
from lowbit.layers.linear import Linear
from lowbit.layers.loading import check_shape, default_loader, expert_loader


def reshard(value, spec: ShardSpec, name: str):
    """The local part of a parameter: a meta parameter of the local shape before loading,
    the cut data after. The spec and a cutting weight loader ride on the parameter."""
    if value is None:
        return None
    if not isinstance(value, nn.Parameter):  # a QuantizedTensor, already loaded
        return take(value, spec, name)
    if value.device.type == "meta":
        data = torch.empty(spec.local, dtype=value.dtype, device="meta")
    else:
        data = take(value.data, spec, name)
    p = nn.Parameter(data, requires_grad=False)
    p.__dict__.update(value.__dict__)
    p.shard_spec = spec
    p.weight_loader = cutting_loader(getattr(value, "weight_loader", None), spec)
    return p


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


def _shape(value) -> tuple[int, ...]:
    return tuple(value.shape)


class ColumnParallelLinear(Linear):
    """Output features split: this rank computes part `index` of `parts` of y."""

    @classmethod
    def of(cls, lin: Linear, index: int, parts: int) -> ColumnParallelLinear:
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.prefix = lin.in_features, lin.prefix
        m.out_features = _divide(lin.out_features, parts, f"{lin.prefix}.weight", "output features")
        m.weight = reshard(lin.weight, ShardSpec(_shape(lin.weight), Split(0, index, parts)), f"{lin.prefix}.weight")
        m.bias = None
        if lin.bias is not None:
            m.bias = reshard(lin.bias, ShardSpec(_shape(lin.bias), Split(0, index, parts)), f"{lin.prefix}.bias")
        return m


class RowParallelLinear(Linear):
    """Input features split; the partial outputs are summed over `group` (unless the caller
    sums them later, reduce=False). Rank 0 of the split holds the bias, the others zeros."""

    group: str = "tp"
    reduce: bool = True

    @classmethod
    def of(cls, lin: Linear, index: int, parts: int, group: str = "tp", reduce: bool = True) -> RowParallelLinear:
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.out_features, m.prefix, m.group, m.reduce = lin.out_features, lin.prefix, group, reduce
        m.in_features = _divide(lin.in_features, parts, f"{lin.prefix}.weight", "input features")
        m.weight = reshard(lin.weight, ShardSpec(_shape(lin.weight), Split(1, index, parts)), f"{lin.prefix}.weight")
        m.bias = None
        if lin.bias is not None:
            m.bias = reshard(lin.bias, ShardSpec(_shape(lin.bias), zero=index != 0), f"{lin.prefix}.bias")
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, K/p] -> [T, N]
        y = linear(x, self.weight, self.bias, layer=self.prefix)
        return ps.all_reduce(y, self.group) if self.reduce else y


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, lo + rows) of the (padded) table; other ids read zeros, the all-reduce fills them."""

    def __init__(self, emb: nn.Embedding, index: int, parts: int) -> None:
        super().__init__()
        V, D = emb.weight.shape
        per = -(-V // parts)
        self.num_embeddings, self.embedding_dim, self.lo, self.rows = V, D, index * per, per
        split = Split(0, index, parts, padded=per * parts)
        self.weight = reshard(emb.weight, ShardSpec((V, D), split), "model.embed_tokens.weight")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        local = ids - self.lo
        inside = (local >= 0) & (local < self.rows)
        h = nn.functional.embedding(local.clamp(0, self.rows - 1), self.weight)
        return ps.all_reduce(h * inside[:, None].to(h.dtype), "tp")


def shard_vocab(model: nn.Module, index: int, parts: int) -> None:
    """Embedding and lm_head split by vocabulary rows; compute_logits gathers the logits."""
    body = model.model
    V = body.embed_tokens.weight.shape[0]
    body.embed_tokens = VocabParallelEmbedding(body.embed_tokens, index, parts)
    if model.lm_head is not None:
        head = model.lm_head
        per = -(-V // parts)
        spec = ShardSpec(_shape(head.weight), Split(0, index, parts, padded=per * parts))
        head.weight = reshard(head.weight, spec, "lm_head.weight")
        head.out_features = per
    local_logits = model.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, V]
        return ps.all_gather(local_logits(hidden), "tp", dim=-1)[:, :V]

    model.compute_logits = compute_logits


def shard_attention(attn: nn.Module, index: int, parts: int) -> None:
    """Split an attention block's heads (GQA, or MLA when it has kv_b_proj)."""
    H = attn.H
    _divide(H, parts, f"{_prefix(attn)} (query heads)", "heads")
    if hasattr(attn, "kv_b_proj"):  # MLA: the latent (kv_a) and q_a are shared by all heads
        q = "q_b_proj" if getattr(attn, "q_lora", False) else "q_proj"
        setattr(attn, q, ColumnParallelLinear.of(getattr(attn, q), index, parts))
        attn.kv_b_proj = ColumnParallelLinear.of(attn.kv_b_proj, index, parts)
    else:
        Hkv = attn.Hkv
        if Hkv % parts and parts % Hkv:
            raise LowbitError(
                f"{_prefix(attn)}: {Hkv} kv heads cannot be split over {parts} ranks, nor copied to "
                f"them evenly; pick a tensor parallel size that divides {Hkv} or is a multiple of it")
        kv_parts = min(Hkv, parts)  # Hkv < p: p/Hkv ranks hold a copy of the same kv head
        kv_index = index * kv_parts // parts
        attn.q_proj = ColumnParallelLinear.of(attn.q_proj, index, parts)
        attn.k_proj = ColumnParallelLinear.of(attn.k_proj, kv_index, kv_parts)
        attn.v_proj = ColumnParallelLinear.of(attn.v_proj, kv_index, kv_parts)
        attn.Hkv = Hkv // kv_parts
    attn.o_proj = RowParallelLinear.of(attn.o_proj, index, parts)
    if isinstance(getattr(attn, "sinks", None), nn.Parameter):  # per-head sink logits (gpt-oss)
        attn.sinks = reshard(attn.sinks, ShardSpec(_shape(attn.sinks), Split(0, index, parts)),
                             f"{_prefix(attn)}.sinks")
    attn.H = H // parts


def shard_mlp(mlp: nn.Module, index: int, parts: int, group: str = "tp", reduce: bool = True) -> None:
    """A gated MLP split on its intermediate dim."""
    mlp.gate_proj = ColumnParallelLinear.of(mlp.gate_proj, index, parts)
    mlp.up_proj = ColumnParallelLinear.of(mlp.up_proj, index, parts)
    mlp.down_proj = RowParallelLinear.of(mlp.down_proj, index, parts, group, reduce)


def _prefix(attn: nn.Module) -> str:
    return attn.o_proj.prefix.rsplit(".", 1)[0]


def _divide(n: int, parts: int, what: str, unit: str) -> int:
    if n % parts:
        raise LowbitError(f"{what}: {n} {unit} do not split over {parts} ranks; "
                          f"pick a parallel size that divides {n}")
    return n // parts
