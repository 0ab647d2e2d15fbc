"""Expert parallelism: a MoE block whose experts are spread over the ranks.

Shapes: T tokens, D hidden, E experts (E/ep per part), A active per token, I expert width,
W ranks. Rank r holds experts [ep_rank*E/ep, (ep_rank+1)*E/ep), each cut to I/moe_tp of
its width (lowbit.distributed.parallel_state has the layout), and shared experts cut to
I_s/W. Routing runs on every rank, on the same replicated activations, so every rank
knows every token's experts without communication.

Two ways to combine, picked by T (host-known, so the choice never syncs):
  all-reduce (T < ALL_TO_ALL_MIN_TOKENS; CUDA-graph capturable):
      local = expert_map[ids]            # [T, A] local expert id, -1 elsewhere
      y = experts(x, local, w) + shared(x)  # [T, D] this rank's partial sum
      y = all_reduce(y)                   # over the world
  all-to-all (large T, pure expert parallel moe_tp == 1, eager steps only):
      each rank takes T/W tokens, sends each (token, slot) row to the owner of its expert,
      the owner runs it, the rows come back, are weighted and summed per token, and the
      chunks are all-gathered (shared experts: reduce-scattered onto the chunks first).
      The row counts are exchanged with one host sync, which is why graphs never use it.
Volumes per rank, all-reduce: ~2 T D (W-1)/W; all-to-all: ~2 T A D (W-1)/W^2 + T D (W-1)/W.
With replicated activations the all-reduce moves less data whenever A >= W/2; the
all-to-all path computes exactly the routed rows (the all-reduce path under a graph runs
the masked slots against local expert 0 with weight 0 until the MoE kernel skips id -1).
The threshold is a placeholder until measured on GPUs (docs/DISTRIBUTED.md).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from lowbit.distributed import parallel_state as ps
from lowbit.distributed.parallel_state import ParallelLayout
from lowbit.distributed.slicing import ShardSpec, Split
from lowbit.distributed.tensor_parallel import reshard, shard_mlp
from lowbit.errors import LowbitError
from lowbit.kernels.router_op import route
from lowbit.layers.moe import Experts, SparseMoE

ALL_TO_ALL_MIN_TOKENS = int(os.environ.get("LOWBIT_EP_ALL_TO_ALL_MIN_TOKENS", "4096"))


def shard_experts(experts: Experts, layout: ParallelLayout) -> tuple[int, int]:
    """Keep this rank's experts, cut to its share of their width; returns (first, count)."""
    E, two_i = experts.w13.shape[0], experts.w13.shape[1]
    name = experts.prefix
    if E % layout.ep:
        raise LowbitError(f"{name}: {E} experts do not split over {layout.ep} expert parallel ranks; "
                          f"pick an --expert-parallel-size that divides {E}")
    if (two_i // 2) % layout.moe_tp:
        raise LowbitError(f"{name}: expert width {two_i // 2} does not split over {layout.moe_tp} ranks "
                          f"(world {layout.world} / expert parallel {layout.ep}); pick sizes that divide it")
    n = E // layout.ep
    first, r, m = layout.ep_rank * n, layout.moe_tp_rank, layout.moe_tp
    specs = {
        "w13": Split(1, r, m, halves=True),  # [E, 2I, D]: gate rows, then up rows
        "w2": Split(2, r, m),  # [E, D, I]
        "b13": Split(1, r, m, halves=True),  # [E, 2I]
    }
    for attr in ("w13", "w2", "b13", "b2"):
        value = getattr(experts, attr)
        if value is None:
            continue
        spec = ShardSpec(tuple(value.shape), specs.get(attr), (first, n), zero=attr == "b2" and r != 0)
        setattr(experts, attr, reshard(value, spec, f"{name}.{attr}"))
    return first, n


class ParallelMoE(nn.Module):
    """SparseMoE over W ranks; same parameter names (gate, e_score_correction_bias,
    experts.*, shared_experts.*), so checkpoints load unchanged."""

    def __init__(self, moe: SparseMoE, layout: ParallelLayout) -> None:
        super().__init__()
        self.spec, self.layout = moe.spec, layout
        self.gate = moe.gate
        self.e_score_correction_bias = moe.e_score_correction_bias
        E = moe.experts.w13.shape[0]
        self.experts = moe.experts
        first, n = shard_experts(self.experts, layout)
        self.first, self.num_local = first, n
        emap = torch.full((E,), -1, dtype=torch.long)
        emap[first:first + n] = torch.arange(n)
        self.register_buffer("expert_map", emap, persistent=False)  # [E] global -> local id or -1
        self.shared_experts = moe.shared_experts
        if self.shared_experts is not None:  # cut over all ranks; joins the routed sum
            shard_mlp(self.shared_experts, layout.rank, layout.world, "world", reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, D], the same on every rank
        gate = self.gate
        ids, w = route(x, gate.weight.float(), None if gate.bias is None else gate.bias.float(),
                       self.spec, self.e_score_correction_bias, layer=f"{self.experts.prefix}.router")  # [T, A]
        if self._use_all_to_all(x.shape[0]):
            return self._all_to_all(x, ids, w)
        y = local_experts(self.experts, x, self.expert_map[ids.long()], w)  # [T, D] partial
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return ps.all_reduce(y, "world")

    def _use_all_to_all(self, T: int) -> bool:
        L = self.layout
        return L.moe_tp == 1 and L.ep > 1 and T >= ALL_TO_ALL_MIN_TOKENS and not capturing(self.expert_map)

    def _all_to_all(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        T, D = x.shape
        W, A, rank = self.layout.world, ids.shape[1], self.layout.rank
        chunk = -(-T // W)
        lo, hi = min(rank * chunk, T), min((rank + 1) * chunk, T)
        owner = ids[lo:hi].long() // self.num_local  # [Tc, A] rank holding each slot's expert
        order = owner.reshape(-1).argsort(stable=True)  # slots grouped by destination
        tok = order // A + lo  # [S] token of each sent row
        counts = torch.bincount(owner.reshape(-1), minlength=W)  # [W]
        recv_counts = ps.all_to_all(counts, [1] * W, [1] * W)
        send, recv = counts.tolist(), recv_counts.tolist()  # the one host sync
        local_ids = (ids[lo:hi].reshape(-1)[order].long() % self.num_local).to(torch.int32)
        x_in = ps.all_to_all(x[tok], send, recv)  # [R, D]
        ids_in = ps.all_to_all(local_ids, send, recv)  # [R]
        y_in = torch.zeros_like(x_in)
        if x_in.shape[0]:
            ones = torch.ones(x_in.shape[0], 1, dtype=w.dtype, device=x.device)
            y_in = self.experts(x_in, ids_in[:, None], ones)  # [R, D]
        y_out = ps.all_to_all(y_in, recv, send)  # [S, D] back in `order`
        wt = w[lo:hi].reshape(-1)[order, None]  # [S, 1]
        y = torch.zeros(chunk, D, dtype=torch.float32, device=x.device)
        y.index_add_(0, tok - lo, y_out.float() * wt)
        if self.shared_experts is not None:
            s = self.shared_experts(x).float()  # [T, D] partial over the world
            s = torch.cat([s, s.new_zeros(chunk * W - T, D)])
            y = y + ps.reduce_scatter(s, "world")
        return ps.all_gather(y.to(x.dtype), "world")[:T]


def capturing(t: torch.Tensor) -> bool:
    """Inside a CUDA graph capture (never on the CPU)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def local_experts(experts: Experts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum over the slots this rank holds (ids >= 0) of w * expert(x); ids [T, A] local.
    Eagerly only those slots are computed; under graph capture the others run against
    expert 0 with weight 0 (fixed shapes, no sync)."""
    held = ids >= 0
    if capturing(x):
        return experts(x, ids.clamp(min=0).to(torch.int32), w * held)
    tok, slot = torch.nonzero(held, as_tuple=True)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if tok.numel():
        y = experts(x[tok], ids[tok, slot, None].to(torch.int32), w[tok, slot, None])  # [S, D]
        out.index_add_(0, tok, y.float())
    return out.to(x.dtype)
