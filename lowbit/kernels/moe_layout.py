"""Hybrid expert layout: which stack, format and global scale serve each expert of a layer.

Shape legend: E experts of the layer (routed, then shared), Eg experts of group g, H hidden,
I expert width. A layout is one or two groups, each a stacked LUT weight pair (w13
[Eg, 2I, H] gate rows then up rows, w2 [Eg, H, I]) of one format, with per-expert global
scales g13 / g2 float32 [Eg, 2] (gate half, up half; w2: both equal) that replace the LUT
views' own global_scale, and a device descriptor expert_group / expert_local int32 [E].
Invariant: every layer expert belongs to exactly one group; all groups share H and I.
Kernels: lowbit.kernels.moe_hybrid. A layout is made from the groups' stacked weights, or
from a lowbit.formats.hybrid.HybridTensor pair (`layout_of`). Pure torch (no triton
import), so layouts can be built anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lowbit.errors import LowbitError
from lowbit.formats.base import LutView
from lowbit.formats.hybrid import HybridTensor
from lowbit.formats.views import LutWeight
from lowbit.kernels.weights import resolve


@dataclass
class ExpertGroup:
    """One format's stack: w13 [Eg, 2I, H], w2 [Eg, H, I], g13 / g2 float32 [Eg, 2]."""

    w13: LutWeight
    w2: LutWeight
    g13: torch.Tensor
    g2: torch.Tensor

    @property
    def size(self) -> int:
        return self.w13.lead[0]


@dataclass
class HybridExperts:
    groups: list[ExpertGroup]  # 1 or 2
    expert_group: torch.Tensor  # int32 [E]
    expert_local: torch.Tensor  # int32 [E]

    @property
    def num_experts(self) -> int:
        return self.expert_group.numel()

    @property
    def hidden(self) -> int:
        return self.groups[0].w2.n

    @property
    def inter(self) -> int:
        return self.groups[0].w13.n // 2

    def formats(self) -> list[str]:
        return [f"lut{g.w13.view.bits}" for g in self.groups]


def _lut(w) -> LutWeight:
    r = resolve(w)
    if not isinstance(r, LutWeight) or len(r.lead) != 1:
        raise LowbitError("hybrid expert groups hold stacked LUT weights [E, N, K] "
                          f"(nvfp4, mxfp4, nf4, nf3, int4, lut3, lut4), got {type(r).__name__}.")
    return r


def make_group(w13, w2) -> ExpertGroup:
    """A group from stacked quantized weights (no copy); g from their global scales."""
    a, b = _lut(w13), _lut(w2)
    if a.lead != b.lead or a.n % 2:
        raise LowbitError(f"w13 {a.lead + (a.n,)} and w2 {b.lead + (b.n,)} do not pair up.")
    dev = a.view.codes.device
    g13 = torch.full((a.lead[0], 2), float(a.view.global_scale), device=dev)
    g2 = torch.full((b.lead[0], 2), float(b.view.global_scale), device=dev)
    return ExpertGroup(a, b, g13, g2)


def hybrid_experts(groups: list[ExpertGroup], members: list[list[int]]) -> HybridExperts:
    """members[g] = the layer experts group g holds, in its stack order."""
    if not 1 <= len(groups) <= 2 or len(members) != len(groups):
        raise LowbitError("a hybrid layout has one or two expert groups.")
    n = 1 + max((max(m) for m in members if m), default=-1)
    grp, loc = torch.full((n,), -1, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
    for g, (group, ids) in enumerate(zip(groups, members)):
        if len(ids) != group.size:
            raise LowbitError(f"group {g} stacks {group.size} experts but lists {len(ids)}.")
        grp[ids] = g
        loc[ids] = torch.arange(len(ids), dtype=torch.int32)
    if (grp < 0).any():
        raise LowbitError("every expert of the layer must belong to exactly one group.")
    h, inter = groups[0].w2.n, groups[0].w13.n // 2
    for group in groups:
        if group.w2.n != h or group.w13.n != 2 * inter:
            raise LowbitError("the groups of a hybrid layout disagree on H or I.")
    dev = groups[0].w13.view.codes.device
    return HybridExperts(groups, grp.to(dev), loc.to(dev))


def with_shared_slots(ids: torch.Tensor, weights: torch.Tensor, first: int, n_shared: int):
    """Append n_shared always-selected slots (experts first .. first+n_shared-1, weight 1.0):
    ids [T, A + n_shared] int32, weights [T, A + n_shared] float32. Device ops only."""
    t = ids.shape[0]
    extra = torch.arange(first, first + n_shared, dtype=torch.int32, device=ids.device)
    ones = torch.ones(t, n_shared, dtype=torch.float32, device=ids.device)
    return (torch.cat([ids.to(torch.int32), extra.expand(t, n_shared)], 1),
            torch.cat([weights.float(), ones], 1))


def _view2d(w) -> LutView:
    r = resolve(w)
    if not isinstance(r, LutWeight) or r.lead:
        raise LowbitError(f"a shared expert weight must be a 2D LUT weight, got {type(r).__name__}.")
    return r.view


def _rows(v: LutView, rows: torch.Tensor) -> LutView:
    """The rows `rows` of a 2D view (a copy), table_index made explicit."""
    ti = v.table_index if v.table_index is not None else torch.zeros(
        v.codes.shape[0], dtype=torch.int32, device=v.codes.device)
    return replace(v, codes=v.codes[rows], table_index=ti[rows], scales=v.scales[rows],
                   offsets=None if v.offsets is None else v.offsets[rows])


def _cols(v: LutView, start: int, width: int) -> LutView:
    """Columns start .. start+width-1 of a 2D view; both multiples of the block size."""
    b = v.block_size
    assert start % b == 0 and width % b == 0 and (width * v.bits) % 8 == 0
    c0, c1 = start * v.bits // 8, (start + width) * v.bits // 8
    return replace(v, codes=v.codes[:, c0:c1], scales=v.scales[:, start // b:(start + width) // b],
                   offsets=None if v.offsets is None else v.offsets[:, start // b:(start + width) // b])


def shared_group(gate, up, down, n_shared: int) -> ExpertGroup:
    """DeepSeek-style shared MLP (gate/up [n_shared * I, H], down [H, n_shared * I], each a
    2D LUT weight of one format) as n_shared experts of width I: exact, since the gated MLP
    is a sum over its intermediate columns. Copies the (small) shared weights once."""
    vg, vu, vd = (_view2d(w) for w in (gate, up, down))
    for v in (vg, vu, vd):
        if v.bits != vg.bits or v.block_size != vg.block_size or v.scale_kind != vg.scale_kind \
                or (v.offsets is None) != (vg.offsets is None) or v.scales.dtype != vg.scales.dtype:
            raise LowbitError("shared expert weights must share one LUT format to be fused.")
    inter = vg.codes.shape[0] // n_shared
    if vg.codes.shape[0] != inter * n_shared or (n_shared > 1 and inter % vd.block_size):
        raise LowbitError(f"shared width {vg.codes.shape[0]} is not {n_shared} blocks-aligned experts.")
    tg = vg.table.shape[0]
    vu = replace(vu, table_index=(torch.zeros(vu.codes.shape[0], dtype=torch.int32, device=vu.codes.device)
                                  if vu.table_index is None else vu.table_index) + tg)
    table = torch.cat([vg.table, vu.table]).contiguous()
    dev = vg.codes.device
    parts13, parts2 = [], []
    for c in range(n_shared):
        r = torch.arange(c * inter, (c + 1) * inter, device=dev)
        pg, pu = _rows(vg, r), _rows(vu, r)
        parts13.append(replace(pg, codes=torch.cat([pg.codes, pu.codes]),
                               table_index=torch.cat([pg.table_index, pu.table_index]),
                               scales=torch.cat([pg.scales, pu.scales]),
                               offsets=None if pg.offsets is None else torch.cat([pg.offsets, pu.offsets])))
        parts2.append(_cols(vd, c * inter, inter) if n_shared > 1 else vd)
    w13 = _stack(parts13, table)
    w2 = _stack(parts2, vd.table)
    g13 = torch.tensor([[vg.global_scale, vu.global_scale]] * n_shared, device=dev)
    g2 = torch.full((n_shared, 2), float(vd.global_scale), device=dev)
    return ExpertGroup(w13, w2, g13, g2)


def _stack(parts: list[LutView], table: torch.Tensor) -> LutWeight:
    v = parts[0]
    ti = [p.table_index for p in parts]
    view = replace(v, codes=torch.stack([p.codes for p in parts]).contiguous(),
                   table=table, scales=torch.stack([p.scales for p in parts]).contiguous(),
                   table_index=None if ti[0] is None else torch.stack(ti).contiguous(),
                   offsets=None if v.offsets is None else torch.stack([p.offsets for p in parts]).contiguous(),
                   global_scale=1.0)
    return resolve(view)


def shared_layout(w13, w2, gate, up, down, n_shared: int) -> HybridExperts | str:
    """Routed experts (stacks w13 / w2, or a one-group HybridExperts) plus a shared gated MLP
    as one layout: routed experts 0 .. E-1, shared E .. E+n_shared-1. Or the reason there is
    none: a weight that is not a LUT weight, or a routed layout that already has two groups
    (then the shared MLP runs as its own dense launches)."""
    try:
        if isinstance(w13, HybridExperts):
            if len(w13.groups) != 1:
                return "the routed experts already hold two formats"
            routed = w13.groups[0]
        else:
            routed = make_group(w13, w2)
        shared = shared_group(gate, up, down, n_shared)
    except LowbitError as e:
        return str(e).rstrip(".")
    if shared.w13.n != routed.w13.n or shared.w2.n != routed.w2.n:
        return "shared and routed experts differ in width"
    e = routed.size
    return hybrid_experts([routed, shared], [list(range(e)), list(range(e, e + n_shared))])


@dataclass
class DenseShared:
    """A MoE block's shared gated MLP (DeepSeek's shared experts) as `n` extra per-slot GEMV
    experts of width I at routing weight 1.0, read where its weights are (no copy): gate_up
    [2S, H] with the gate rows [0, S) and the up rows [S, 2S), down [H, S], S = n * I; expert
    c is gate / up rows [c I, (c + 1) I) and down columns [c I, (c + 1) I). Exact: a gated
    MLP is the sum over its intermediate columns. Dense weights of the routed stacks' dtype."""

    gate_up: torch.Tensor
    down: torch.Tensor
    n: int


class SharedMLP:
    """A MoE block's shared gated MLP (DeepSeek's shared experts) as the moe op takes it.

    `mlp` owns the weights (gate_proj / up_proj / down_proj, each with a `.weight`: gate and
    up [S, H], down [H, S], S = n_shared x I) and runs the MLP on its own: mlp(x [T, H]) ->
    [T, H]. `fused` builds the routed + shared layout at first use and keeps it here, on the
    block that holds both weight sets, until one of the weights is replaced."""

    def __init__(self, mlp) -> None:
        self.mlp = mlp
        self._fused: tuple | None = None  # (the five weights it was made from, layout or reason)
        self._dense: tuple | None = None  # (the two weights it was made from, DenseShared)

    def dense(self, inter: int) -> DenseShared | None:
        """The merged dense form (a GateUpMLP after prepare_for_serving: gate_up [2S, H] and
        down [H, S], plain tensors, S a multiple of the routed width `inter`) as shared
        expert slots of the routed gemv, or None."""
        gu = getattr(self.mlp, "gate_up_proj", None)
        down = self.mlp.down_proj.weight
        if gu is None or gu.bias is not None or self.mlp.down_proj.bias is not None:
            return None
        if not isinstance(gu.weight, torch.Tensor) or not isinstance(down, torch.Tensor) or down.shape[1] % inter:
            return None
        if self._dense is None or self._dense[0] is not gu.weight or self._dense[1] is not down:
            self._dense = (gu.weight, down, DenseShared(gu.weight, down, down.shape[1] // inter))
        return self._dense[2]

    def fused(self, w13, w2) -> HybridExperts | str:
        """The layout of routed stacks w13 / w2 (w2 None: w13 is a HybridExperts) followed by
        the shared experts, or the reason they cannot share the routed launch."""
        m = self.mlp
        weights = (w13, w2, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)
        if self._fused is None or any(a is not b for a, b in zip(self._fused[0], weights)):
            self._fused = (weights, _fuse(*weights))
        return self._fused[1]


def _fuse(w13, w2, gate, up, down) -> HybridExperts | str:
    inter = w13.inter if isinstance(w13, HybridExperts) else w13.n // 2
    width = gate.shape[0]
    if width % inter:
        return f"shared width {width} is not whole experts of width {inter}"
    return shared_layout(w13, w2, gate, up, down, width // inter)


def layout_of(w13: HybridTensor, w2: HybridTensor) -> HybridExperts:
    """The kernel layout of a hybrid w13 / w2 pair (same parts and members); cached on w13."""
    if w13._layout is not None and w13._layout[0] is w2:
        return w13._layout[1]
    if w13.members != w2.members:
        raise LowbitError("hybrid w13 and w2 must split the experts the same way.")
    parts = list(w13.parts)
    layout = hybrid_experts([make_group(w13.parts[k], w2.parts[k]) for k in parts],
                            [w13.members[k] for k in parts])
    w13._layout = (w2, layout)
    return layout
