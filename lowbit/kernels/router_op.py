"""The `router` op: a MoE layer's gate logits -> the top-k experts of each token and weights.

Shape legend: T tokens, D hidden, E experts, A active experts per token (top_k),
G expert groups (n_group), GS = E / G experts per group.
  logits = gate_logits(x, w, b)            # [T, E] float32 (one cuBLAS GEMM)
  ids, w = route_topk(logits, spec, bias)  # [T, A] int32, [T, A] float32
scores = softmax(logits) or sigmoid(logits); the choice ranks scores + bias (DeepSeek-V3's
score correction, which picks experts but does not weight them); with G > 1 only the
topk_group best groups (group score: top-2 sum or max of the choice) stay eligible. The
weights are the chosen experts' scores, optionally renormalized to sum 1, times scaling.
ids come in descending choice order.

Routes, in selection order:
  triton_topk   one program per token row: scores over E, group mask, top-k by repeated
                argmax (ties to the lowest index), renormalize, scale; no host read
                (graph-safe). Refuses E > 1024, top_k > 16, non-float32 logits.
  torch         reference: torch.topk over the float32 scores (admits every call)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowbit.kernels import routes
from lowbit.kernels.runtime import tl, triton, triton_refusal

RECORD = "docs/BENCHMARKS.md#decode-graph"
MAX_EXPERTS = 1024
MAX_TOP_K = 16
SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2sum", "max")


@dataclass
class RouterSpec:
    top_k: int
    scoring: str = "softmax"  # softmax | sigmoid
    norm_topk: bool = True
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2sum"  # top2sum (deepseek_v3) | max (deepseek_v2)
    scaling: float = 1.0


@dataclass
class RouterCall:
    logits: torch.Tensor  # [T, E]
    spec: RouterSpec
    bias: torch.Tensor | None  # [E] score correction, or None
    forced: bool = False


def gate_logits(x: torch.Tensor, weight_f32: torch.Tensor,
                bias_f32: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D] -> [T, E] float32: the gate GEMM in float32, with a weight [E, D] (and bias
    [E]) the caller converted to float32 once at load."""
    return F.linear(x.float(), weight_f32, bias_f32)


def reference_route(logits: torch.Tensor, spec: RouterSpec,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (ids [T, A] int32, weights [T, A] float32). Runs on the device."""
    scores = torch.sigmoid(logits.float()) if spec.scoring == "sigmoid" else torch.softmax(logits.float(), -1)
    choice = scores if bias is None else scores + bias.float()
    if spec.n_group > 1:
        T, E = choice.shape
        grouped = choice.view(T, spec.n_group, E // spec.n_group)
        if spec.group_score == "top2sum":
            gscore = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        else:
            gscore = grouped.max(dim=-1).values
        keep = torch.zeros_like(gscore).scatter_(1, gscore.topk(spec.topk_group, dim=-1).indices, 1.0)
        mask = keep[:, :, None].expand_as(grouped).reshape(T, E)
        choice = choice.masked_fill(mask == 0, float("-inf"))  # biased scores may be < 0
    ids = choice.topk(spec.top_k, dim=-1).indices  # [T, A]
    w = scores.gather(1, ids)
    if spec.norm_topk:
        w = w / (w.sum(-1, keepdim=True) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
    return ids.to(torch.int32), w * spec.scaling


# -- the Triton route -------------------------------------------------------------------------
@triton.jit
def _argmax_first(v, idx, BIG: tl.constexpr):
    """(max of v, the lowest idx holding it) over a 2-D block."""
    best = tl.max(tl.max(v, 1), 0)
    return best, tl.min(tl.min(tl.where(v == best, idx, BIG), 1), 0)


@triton.jit
def _group_mask(choice, g, j, G: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP2: tl.constexpr,
                BG: tl.constexpr, BGS: tl.constexpr):
    """[BG, 1] bool: the TOPK_GROUP groups with the best group score (ties: lowest group)."""
    gmax = tl.max(choice, 1)  # [BG]
    gscore = gmax
    if TOP2:  # drop one copy of the max, add the next best
        first = tl.min(tl.where(choice == gmax[:, None], j, BGS), 1)
        gscore = gmax + tl.max(tl.where(j == first[:, None], float("-inf"), choice), 1)
    gs = tl.arange(0, BG)
    gscore = tl.where(gs < G, gscore, float("-inf"))
    keep = gs < 0
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(gscore, 0)
        pick = tl.min(tl.where(gscore == best, gs, BG), 0)
        keep = keep | (gs == pick)
        gscore = tl.where(gs == pick, float("-inf"), gscore)
    return keep[:, None]


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, stride_t, scaling,
                   G: tl.constexpr, GS: tl.constexpr, BG: tl.constexpr, BGS: tl.constexpr,
                   A: tl.constexpr, BA: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                   TOP2: tl.constexpr):
    """Row t of logits [T, E] (row stride stride_t, unit column stride) -> ids [T, A] int32,
    w [T, A] float32 (contiguous). The row sits in a [BG, BGS] block: expert g * GS + j."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BG)[:, None]
    j = tl.arange(0, BGS)[None, :]
    e = g * GS + j  # [BG, BGS]
    valid = (g < G) & (j < GS)
    x = tl.load(logits_ptr + t * stride_t + e, mask=valid, other=float("-inf"))
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        p = tl.exp(x - tl.max(tl.max(x, 1), 0))
        scores = p / tl.sum(tl.sum(p, 1), 0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=valid, other=0.0)
    choice = tl.where(valid, choice, float("-inf"))
    if G > 1:
        choice = tl.where(_group_mask(choice, g, j, G, TOPK_GROUP, TOP2, BG, BGS), choice, float("-inf"))
    slots = tl.arange(0, BA)
    ids = tl.zeros([BA], dtype=tl.int32)
    w = tl.zeros([BA], dtype=tl.float32)
    for a in tl.static_range(A):
        _, pick = _argmax_first(choice, e, BG * BGS)
        hit = e == pick
        ids = tl.where(slots == a, pick, ids)
        w = tl.where(slots == a, tl.sum(tl.sum(tl.where(hit, scores, 0.0), 1), 0), w)
        choice = tl.where(hit, float("-inf"), choice)
    if NORM:
        w = w / (tl.sum(w, 0) + (1e-20 if SIGMOID else 0.0))
    tl.store(ids_ptr + t * A + slots, ids, mask=slots < A)
    tl.store(w_ptr + t * A + slots, w * scaling, mask=slots < A)


def _refusal(call: RouterCall) -> str | None:
    logits, spec, bias = call.logits, call.spec, call.bias
    reason = triton_refusal(logits, call.forced)
    if reason is not None:
        return reason
    if logits.dtype != torch.float32 or logits.dim() != 2:
        return f"logits are {logits.dtype} of {logits.dim()} dims (the kernel reads [T, E] float32)"
    E = logits.shape[1]
    if E > MAX_EXPERTS:
        return f"{E} experts > {MAX_EXPERTS} (one row per program)"
    if not 1 <= spec.top_k <= min(MAX_TOP_K, E):
        return f"top_k {spec.top_k} is outside 1..{min(MAX_TOP_K, E)}"
    if spec.scoring not in SCORINGS:
        return f"scoring {spec.scoring!r} is not one of {', '.join(SCORINGS)}"
    if bias is not None and (bias.shape != (E,) or bias.device != logits.device):
        return f"score bias of shape {tuple(bias.shape)} on {bias.device} does not match [{E}] logits"
    if spec.n_group > 1:
        return _group_refusal(spec, E)
    return None


def _group_refusal(spec: RouterSpec, E: int) -> str | None:
    if E % spec.n_group:
        return f"{E} experts do not split into {spec.n_group} groups"
    gs = E // spec.n_group
    if spec.group_score not in GROUP_SCORES or (spec.group_score == "top2sum" and gs < 2):
        return f"group score {spec.group_score!r} over groups of {gs} experts"
    if not 1 <= spec.topk_group <= spec.n_group or spec.top_k > spec.topk_group * gs:
        return f"top_k {spec.top_k} from {spec.topk_group} of {spec.n_group} groups of {gs}"
    return None


def _run_triton(call: RouterCall) -> tuple[torch.Tensor, torch.Tensor]:
    logits, spec = call.logits, call.spec
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    T, E = logits.shape
    A = spec.top_k
    ids = torch.empty(T, A, dtype=torch.int32, device=logits.device)
    w = torch.empty(T, A, dtype=torch.float32, device=logits.device)
    if T == 0:
        return ids, w
    G = max(spec.n_group, 1)
    GS = E // G
    bias = logits if call.bias is None else call.bias.float().contiguous()
    BGS = triton.next_power_of_2(GS)
    _router_kernel[(T,)](
        logits, bias, ids, w, logits.stride(0), float(spec.scaling),
        G=G, GS=GS, BG=triton.next_power_of_2(G), BGS=BGS, A=A, BA=triton.next_power_of_2(A),
        TOPK_GROUP=spec.topk_group if G > 1 else 1, SIGMOID=spec.scoring == "sigmoid",
        HAS_BIAS=call.bias is not None, NORM=bool(spec.norm_topk), TOP2=spec.group_score == "top2sum",
        num_warps=4 if G * BGS >= 512 else 1)
    return ids, w


def _run_torch(call: RouterCall) -> tuple[torch.Tensor, torch.Tensor]:
    return reference_route(call.logits, call.spec, call.bias)


routes.register("router", routes.Route(
    "triton_topk", routes.DEFAULT, RECORD, _refusal, _run_triton))
routes.register("router", routes.Route(
    "torch", routes.DEFAULT, "reference (admits every call; torch.topk, graph-safe)",
    lambda call: None, _run_torch), reference=True)


def route_topk(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None, *,
               layer: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (ids [T, A] int32, weights [T, A] float32), by the route the
    registry picks for this call."""
    return routes.dispatch("router", RouterCall(logits, spec, bias), layer)
