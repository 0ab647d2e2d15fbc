"""The `router` op: a MoE layer's gate logits -> the top-k experts of each token and weights.

Shape legend: T tokens, D hidden, E experts, A active experts per token (top_k),
G expert groups (n_group), GS = E / G experts per group.
  ids, w = route(x, gate_w, gate_b, spec, bias)  # [T, A] int32, [T, A] float32
  logits = gate_logits(x, gate_w, gate_b)        # [T, E] float32, what the routes rank
  ids, w = route_topk(logits, spec, bias)        # the same op on logits already made
The gate weight [E, D] (and bias [E]) is float32, converted once at load.
scores = softmax(logits) or sigmoid(logits); the choice ranks scores + bias (DeepSeek-V3's
score correction, which picks experts but does not weight them); with G > 1 only the
topk_group best groups (group score: top-2 sum or max of the choice) stay eligible. The
weights are the chosen experts' scores, optionally renormalized to sum 1, times scaling.
ids come in descending choice order.

Routes, in selection order:
  triton_gate_topk  (MEASURED_NEGATIVE: 3-7x slower than the two launches below on the
                H200, in its four-warp form) T <= 16 tokens: the gate GEMV and the top-k in
                one launch. Programs own (token, block of BE experts) and write that block's
                logits to a workspace; the program that arrives last for a token (a
                per-token counter, reset after use) ranks the whole row as triton_topk does.
                No host read.
  triton_topk   the gate logits by _gate_gemv_kernel up to 16 tokens, or 64 when T x E x D
                <= 2**25 (x read in its own dtype: no float32 copy, one launch instead of
                cuBLAS's copy + GEMV + reduce; H200: 4.1 against 8.6 us with the top-k at
                Qwen3-30B-A3B T = 1; otherwise one cuBLAS GEMM), then one program per token row: scores over
                E, group mask, top-k by repeated argmax (ties to the lowest index),
                renormalize, scale; no host read (graph-safe). Refuses E > 1024,
                top_k > 16, non-float32 logits.
  torch         reference: torch.topk over the float32 scores (admits every call)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowbit.kernels import launch, routes
from lowbit.kernels.pdl import pdl_enter
from lowbit.kernels.runtime import semaphore, tl, triton, triton_refusal

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
    logits: torch.Tensor | None  # [T, E] float32, or None: the route makes them from x
    spec: RouterSpec
    bias: torch.Tensor | None  # [E] score correction, or None
    forced: bool = False
    x: torch.Tensor | None = None  # [T, D]
    gate_w: torch.Tensor | None = None  # [E, D] float32
    gate_b: torch.Tensor | None = None  # [E] float32

    def rows(self) -> torch.Tensor:
        """The float32 logits [T, E] (made from x by one GEMM when not given)."""
        if self.logits is None:
            self.logits = gate_logits(self.x, self.gate_w, self.gate_b)
        return self.logits

    @property
    def num_experts(self) -> int:
        return self.logits.shape[1] if self.logits is not None else self.gate_w.shape[0]

    @property
    def device(self) -> torch.device:
        return (self.logits if self.logits is not None else self.x).device


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
def _row_block(G: tl.constexpr, GS: tl.constexpr, BG: tl.constexpr, BGS: tl.constexpr):
    """A logits row as a [BG, BGS] block: expert e = g * GS + j, and which of them exist."""
    g = tl.arange(0, BG)[:, None]
    j = tl.arange(0, BGS)[None, :]
    return g, j, g * GS + j, (g < G) & (j < GS)


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, stride_t, scaling,
                   G: tl.constexpr, GS: tl.constexpr, BG: tl.constexpr, BGS: tl.constexpr,
                   A: tl.constexpr, BA: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                   TOP2: tl.constexpr, PDL: tl.constexpr):
    """Row t of logits [T, E] (row stride stride_t, unit column stride) -> ids [T, A] int32,
    w [T, A] float32 (contiguous)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    g, j, e, valid = _row_block(G, GS, BG, BGS)
    x = tl.load(logits_ptr + t * stride_t + e, mask=valid, other=float("-inf"))
    _rank_row(x, t, g, j, e, valid, bias_ptr, ids_ptr, w_ptr, scaling, G, BG, BGS, A, BA,
              TOPK_GROUP, SIGMOID, HAS_BIAS, NORM, TOP2)


@triton.jit
def _gate_rows(x_ptr, stride_x, t, tmask, gw_ptr, gb_ptr, es, emask, D,
               BT: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr, HAS_GB: tl.constexpr):
    """float32 logits [BT, BE] of token rows t [BT] for experts es [BE]: x read in its own
    dtype, products and sums in float32, D in steps of BD (each weight tile read once for
    the BT tokens)."""
    acc = tl.zeros([BT, BE], tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        dm = d < D
        xv = tl.load(x_ptr + t.to(tl.int64)[:, None] * stride_x + d[None, :],
                     mask=tmask[:, None] & dm[None, :], other=0).to(tl.float32)
        wv = tl.load(gw_ptr + es.to(tl.int64)[:, None] * D + d[None, :],
                     mask=emask[:, None] & dm[None, :], other=0)
        acc += tl.sum(xv[:, None, :] * wv[None, :, :], 2)
    if HAS_GB:
        acc += tl.load(gb_ptr + es, mask=emask, other=0)[None, :]
    return acc


@triton.jit
def _gate_gemv_kernel(x_ptr, gw_ptr, gb_ptr, out_ptr, T, D, E, stride_x,
                      BT: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr, HAS_GB: tl.constexpr,
                      PDL: tl.constexpr):
    """Program (tb, eb): logits [T, E] float32 of tokens tb * BT .. + BT, experts eb * BE .. + BE."""
    pdl_enter(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    es = tl.program_id(1) * BE + tl.arange(0, BE)
    tmask = t < T
    emask = es < E
    lg = _gate_rows(x_ptr, stride_x, t, tmask, gw_ptr, gb_ptr, es, emask, D, BT, BE, BD, HAS_GB)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * E + es[None, :], lg,
             mask=tmask[:, None] & emask[None, :])


@triton.jit
def _gate_topk_kernel(x_ptr, gw_ptr, gb_ptr, ws_ptr, sem_ptr, bias_ptr, ids_ptr, w_ptr,
                      D, E, NB, stride_x, scaling,
                      BE: tl.constexpr, BD: tl.constexpr, HAS_GB: tl.constexpr,
                      G: tl.constexpr, GS: tl.constexpr, BG: tl.constexpr, BGS: tl.constexpr,
                      A: tl.constexpr, BA: tl.constexpr, TOPK_GROUP: tl.constexpr,
                      SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                      TOP2: tl.constexpr):
    """Program (t, b): logits of token t for experts b * BE .. + BE into ws [T, E]; the NB-th
    program of token t to arrive ranks ws[t] (same rule as _router_kernel) and resets its
    counter."""
    t = tl.program_id(0)
    es = tl.program_id(1) * BE + tl.arange(0, BE)
    emask = es < E
    one = tl.arange(0, 1) + t
    lg = _gate_rows(x_ptr, stride_x, one, one >= 0, gw_ptr, gb_ptr, es, emask, D, 1, BE, BD, HAS_GB)
    t = t.to(tl.int64)
    tl.store(ws_ptr + t * E + es[None, :], lg, mask=emask[None, :])
    tl.debug_barrier()
    arrived = tl.atomic_add(sem_ptr + t, 1, sem="acq_rel", scope="gpu")
    if arrived == NB - 1:
        g, j, e, valid = _row_block(G, GS, BG, BGS)
        x = tl.load(ws_ptr + t * E + e, mask=valid, other=float("-inf"), cache_modifier=".cg")
        _rank_row(x, t, g, j, e, valid, bias_ptr, ids_ptr, w_ptr, scaling, G, BG, BGS, A, BA,
                  TOPK_GROUP, SIGMOID, HAS_BIAS, NORM, TOP2)
        tl.atomic_xchg(sem_ptr + t, 0, sem="relaxed", scope="gpu")


@triton.jit
def _rank_row(x, t, g, j, e, valid, bias_ptr, ids_ptr, w_ptr, scaling, G: tl.constexpr,
              BG: tl.constexpr, BGS: tl.constexpr, A: tl.constexpr, BA: tl.constexpr,
              TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
              NORM: tl.constexpr, TOP2: tl.constexpr):
    """Scores, group mask and top-k of one logits row x [BG, BGS] -> row t of ids and w."""
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        p = tl.exp(x - tl.max(tl.max(x, 1), 0))
        scores = p / tl.sum(tl.sum(p, 1), 0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=valid, other=0.0)
    # a NaN score is never picked: a NaN row (a broken model, stale padding) still names
    # experts 0.. in range, where the argmax sentinel BG * BGS would index past the stack
    choice = tl.where(valid & (choice == choice), choice, float("-inf"))
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
    reason = triton_refusal(logits if logits is not None else call.x, call.forced)
    if reason is not None:
        return reason
    if logits is not None and (logits.dtype != torch.float32 or logits.dim() != 2):
        return f"logits are {logits.dtype} of {logits.dim()} dims (the kernel reads [T, E] float32)"
    E = call.num_experts
    if E > MAX_EXPERTS:
        return f"{E} experts > {MAX_EXPERTS} (one row per program)"
    if not 1 <= spec.top_k <= min(MAX_TOP_K, E):
        return f"top_k {spec.top_k} is outside 1..{min(MAX_TOP_K, E)}"
    if spec.scoring not in SCORINGS:
        return f"scoring {spec.scoring!r} is not one of {', '.join(SCORINGS)}"
    if bias is not None and (bias.shape != (E,) or bias.device != call.device):
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


def _rank_consts(spec: RouterSpec, E: int, has_bias: bool) -> dict:
    G = max(spec.n_group, 1)
    GS = E // G
    return dict(G=G, GS=GS, BG=triton.next_power_of_2(G), BGS=triton.next_power_of_2(GS),
                A=spec.top_k, BA=triton.next_power_of_2(spec.top_k),
                TOPK_GROUP=spec.topk_group if G > 1 else 1, SIGMOID=spec.scoring == "sigmoid",
                HAS_BIAS=has_bias, NORM=bool(spec.norm_topk), TOP2=spec.group_score == "top2sum")


def _outputs(T: int, A: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(T, A, dtype=torch.int32, device=device),
            torch.empty(T, A, dtype=torch.float32, device=device))


GEMV_MAX_TOKENS = 64
GEMV_MAX_WORK = 1 << 25  # T x E x D above 16 tokens: DeepSeek-V3 at T = 64 is 2x slower than cuBLAS


def _gemv_refusal(call: RouterCall) -> str | None:
    """Why the gate logits of this call come from cuBLAS (a float32 copy of x, then the
    GEMM) rather than _gate_gemv_kernel, or None."""
    if call.x is None:
        return "logits were made by the caller"
    x, gw, gb = call.x, call.gate_w, call.gate_b
    T, E = x.shape[0], gw.shape[0]
    if T > GEMV_MAX_TOKENS or (T > 16 and T * E * x.shape[1] > GEMV_MAX_WORK):
        return f"{T} tokens x {E} experts x {x.shape[1]}: one cuBLAS GEMM"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.stride(-1) != 1:
        return f"x is {x.dtype} with column stride {x.stride(-1)} (the kernel reads unit-stride rows)"
    if gw.dtype != torch.float32 or not gw.is_contiguous() or gw.shape[1] != x.shape[1]:
        return f"gate weight {gw.dtype} {tuple(gw.shape)} is not a contiguous float32 [E, {x.shape[1]}]"
    if gb is not None and (gb.dtype != torch.float32 or not gb.is_contiguous()):
        return "gate bias is not a contiguous float32 [E]"
    return None


def gemv_config(T: int, E: int, D: int) -> dict:
    """Launch shape of _gate_gemv_kernel: 2 experts a program (64 programs a token row at
    E = 128), up to 4 tokens sharing each weight tile, a [BT, BE, BD] product of <= 8,192
    float32 over 4 warps (16 loads in flight a thread)."""
    bt = min(4, triton.next_power_of_2(max(T, 1)))
    be = 2
    bd = max(64, min(triton.next_power_of_2(D), 8192 // (bt * be)))
    return dict(BT=bt, BE=be, BD=bd, num_warps=4)


def triton_gate_logits(x: torch.Tensor, gate_w: torch.Tensor, gate_b: torch.Tensor | None,
                       config: dict | None = None) -> torch.Tensor:
    """x [T, D] (bf16 / fp16 / fp32) -> [T, E] float32 logits in one launch, no copy of x."""
    T, D = x.shape
    E = gate_w.shape[0]
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T == 0:
        return out
    cfg = config or gemv_config(T, E, D)
    launch.run(_gate_gemv_kernel, (triton.cdiv(T, cfg["BT"]), triton.cdiv(E, cfg["BE"])),
        x, gate_w, gate_w if gate_b is None else gate_b, out, T, D, E, x.stride(0),
        BT=cfg["BT"], BE=cfg["BE"], BD=cfg["BD"], HAS_GB=gate_b is not None,
        num_warps=cfg["num_warps"], **launch.pdl_args(x))
    return out


def _run_triton(call: RouterCall) -> tuple[torch.Tensor, torch.Tensor]:
    if call.logits is None and _gemv_refusal(call) is None:
        call.logits = triton_gate_logits(call.x, call.gate_w, call.gate_b)
    logits, spec = call.rows(), call.spec
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    T, E = logits.shape
    ids, w = _outputs(T, spec.top_k, logits.device)
    if T == 0:
        return ids, w
    bias = logits if call.bias is None else call.bias.float().contiguous()
    consts = _rank_consts(spec, E, call.bias is not None)
    launch.run(_router_kernel, (T,),
        logits, bias, ids, w, logits.stride(0), float(spec.scaling), **consts,
        num_warps=4 if consts["G"] * consts["BGS"] >= 512 else 1, **launch.pdl_args(logits))
    return ids, w


FUSED_MAX_TOKENS = 16


def _admit_fused(call: RouterCall) -> str | None:
    if call.x is None:
        return "logits were made by the caller (the fused route makes them from x)"
    if call.x.shape[0] > FUSED_MAX_TOKENS:
        return f"{call.x.shape[0]} tokens > {FUSED_MAX_TOKENS}: one cuBLAS GEMM, then triton_topk"
    return _refusal(call) or _gemv_refusal(call)


def fused_config(E: int, D: int, spec: RouterSpec) -> dict:
    """Launch shape of _gate_topk_kernel: 2 experts a program, one warp when the ranking
    tail fits it (its repeated arg-max is then warp shuffles, with no shared-memory round
    trips), 1,024 columns a step."""
    wide = max(spec.n_group, 1) * triton.next_power_of_2(E // max(spec.n_group, 1)) >= 512
    return dict(BE=2, BD=max(64, min(triton.next_power_of_2(D), 1024)), num_warps=4 if wide else 1)


def _run_fused(call: RouterCall, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    x, gw, spec = call.x, call.gate_w, call.spec
    T, D = x.shape
    E = gw.shape[0]
    ids, w = _outputs(T, spec.top_k, x.device)
    if T == 0:
        return ids, w
    cfg = config or fused_config(E, D, spec)
    nb = triton.cdiv(E, cfg["BE"])
    ws = torch.empty(T, E, dtype=torch.float32, device=x.device)
    bias = ws if call.bias is None else call.bias.float().contiguous()
    launch.run(_gate_topk_kernel, (T, nb),
        x, gw, gw if call.gate_b is None else call.gate_b, ws, semaphore(x.device, T), bias,
        ids, w, D, E, nb, x.stride(0), float(spec.scaling), BE=cfg["BE"], BD=cfg["BD"],
        HAS_GB=call.gate_b is not None, **_rank_consts(spec, E, call.bias is not None),
        num_warps=cfg["num_warps"])
    return ids, w


def _run_torch(call: RouterCall) -> tuple[torch.Tensor, torch.Tensor]:
    return reference_route(call.rows(), call.spec, call.bias)


routes.register("router", routes.Route(
    "triton_gate_topk", routes.MEASURED_NEGATIVE, "docs/BENCHMARKS.md#kernels (router rows, "
    "H200, graph replay: 7.0-8.1 us at Qwen3-30B-A3B T = 1-16 and 27-28 us at DeepSeek-V3, "
    "against 2.3-2.5 and 3.7 us for the float32 GEMM + triton_topk)", _admit_fused, _run_fused))
routes.register("router", routes.Route(
    "triton_topk", routes.DEFAULT, RECORD, _refusal, _run_triton))
routes.register("router", routes.Route(
    "torch", routes.DEFAULT, "reference (admits every call; torch.topk, graph-safe)",
    lambda call: None, _run_torch), reference=True)


def route(x: torch.Tensor, gate_w: torch.Tensor, gate_b: torch.Tensor | None, spec: RouterSpec,
          bias: torch.Tensor | None = None, *, layer: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], the float32 gate weight [E, D] and bias [E] -> (ids [T, A] int32, weights
    [T, A] float32): the gate and the top-k by the routes the registry picks."""
    return routes.dispatch("router", RouterCall(None, spec, bias, x=x, gate_w=gate_w, gate_b=gate_b), layer)


def route_topk(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None, *,
               layer: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (ids [T, A] int32, weights [T, A] float32), by the route the
    registry picks for this call."""
    return routes.dispatch("router", RouterCall(logits, spec, bias), layer)
