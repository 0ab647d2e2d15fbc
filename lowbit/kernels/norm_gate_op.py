"""The `norm_gate` op: a MoE layer's post-attention residual add + RMSNorm and its router's gate
logits, for a decode step's few tokens.

Shape legend: T tokens, D hidden, E experts, A experts a token (top_k).
  y, r, logits, ids, w = norm_gate(x, weight, eps, residual, gate_w, gate_b, spec=, bias=)
    r = x + residual (x when residual is None), y = RMSNorm(r) * weight (norm_op's roundings),
    logits = y @ gate_w^T (+ gate_b) in float32 [T, E], or None: the router then makes them
    from y as it does without this op (lowbit.kernels.router_op.route); ids [T, A] int32 and
    w [T, A] float32, the router's choice of those logits (spec, bias: router_op's), or None:
    the router ranks them.
Why: a decode step's norm, gate GEMV and top-k each cost a launch that moves almost nothing
(3.5, 4.1 and 4.2 us alone at Qwen3-30B-A3B B = 1 on the H100; docs/BENCHMARKS.md "A decode
step under Nsight Compute"). One launch does the first two, or all three: every gate program
reads its tokens' whole rows (8 KiB a token at D = 2048, from L2) and normalizes them itself.

Routes, in selection order (`scripts/with_route.py norm_gate ROUTE -- ...` or `bench latency
--variant x=norm_gate:ROUTE` runs one where it admits the call; LOWBIT_ROUTE_NORM_GATE forces
it and fails on a prefill's longer calls):
  triton_norm_route  MEASURED_NEGATIVE: in the engine A/B (H100, Qwen3-30B-A3B,
                bench/records/20261207T151549 / T151828-latency-h100.json) nvfp4 tg128 runs
                at 0.947x (B = 1) and 0.896x (B = 8), bf16 at 0.983x / 0.951x: two launches
                fewer a layer, but the last program's ranking is a serial tail after every
                gate program, where the router's own launch overlapped under PDL.
                triton_norm_gate's launch, and the program that arrives last for a
                token block (a counter per block, reset after use) ranks the block's rows as
                router_op's triton_topk does (router_op._rank_row): the router's launch too.
                Refuses what triton_norm_gate or triton_topk refuses, and calls without a
                router spec.
  triton_norm_gate  DEFAULT: nvfp4 tg128 1.035x at B = 1 (busy step 2,399 against 2,445
                us), 1.003x at B = 8 (H100, bench/records/20261207T154612-latency-h100.json,
                `--variant normgate=norm_gate:triton_norm_gate`); on the H200 (959c1b7,
                bench/records/20261207T171256 / T171431-latency-h200.json) the unfused pair
                runs nvfp4 C1 at 0.976x and bf16 C1 at 0.982x of it, level at B = 8 and 32.
                T <= 16 tokens, D <= 8192: program (token block, expert block) adds the
                residual, normalizes its BT rows in float32 with norm_op's roundings, and
                takes the dot products with its BE experts' float32 gate rows (read before
                the PDL wait); the programs of expert block 0 store r and y. No host read
                (graph-safe).
  unfused       reference: norm_op.rms_norm by its own routes, logits None (the router's
                own routes make them). Admits every call; not slow (today's path), so a
                fallback to it warns of nothing (routes.register slow=False).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.kernels import launch, norm_op, router_op, routes
from lowbit.kernels.norm_op import DTYPE_CODE, round_to
from lowbit.kernels.pdl import pdl_enter
from lowbit.kernels.router_op import RouterCall, RouterSpec, _rank_consts, _rank_row, _row_block
from lowbit.kernels.runtime import semaphore, tl, triton

RECORD = ("docs/BENCHMARKS.md \"Fused decode routes, timed\" (triton_norm_gate: nvfp4 C1 1.035x; "
          "triton_norm_route: 0.947x; bench/records/20261207T154612 / T151549-latency-h100.json)")
MAX_TOKENS = 16
MAX_D = 8192


@dataclass
class NormGateCall:
    x: torch.Tensor  # [T, D]
    weight: torch.Tensor  # [D]
    eps: float
    residual: torch.Tensor | None  # [T, D]
    gate_w: torch.Tensor  # [E, D] float32
    gate_b: torch.Tensor | None  # [E] float32
    spec: RouterSpec | None = None  # the router's, for a route that ranks too
    bias: torch.Tensor | None = None  # [E] score correction (router_op)
    forced: bool = False


def _run_unfused(call: NormGateCall):
    y, r = norm_op.rms_norm(call.x, call.weight, call.eps, call.residual)
    return y, r, None, None, None


@triton.jit
def _norm_gate_kernel(x_ptr, res_ptr, w_ptr, y_ptr, r_ptr, gw_ptr, gb_ptr, out_ptr, T, D, E,
                      d_float, stride_x, stride_res, eps, sem_ptr, bias_ptr, ids_ptr, wo_ptr, NB,
                      scaling, BT: tl.constexpr, BE: tl.constexpr,
                      BLOCK_D: tl.constexpr, XDT: tl.constexpr, YDT: tl.constexpr,
                      HAS_RES: tl.constexpr, HAS_GB: tl.constexpr, PDL: tl.constexpr,
                      RANK: tl.constexpr = False, G: tl.constexpr = 1, GS: tl.constexpr = 1,
                      BG: tl.constexpr = 1, BGS: tl.constexpr = 1, A: tl.constexpr = 1,
                      BA: tl.constexpr = 1, TOPK_GROUP: tl.constexpr = 1,
                      SIGMOID: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
                      NORM: tl.constexpr = False, TOP2: tl.constexpr = False):
    """Program (tb, eb): tokens tb * BT .. + BT, experts eb * BE .. + BE. The norm and gate
    weights are read before the PDL wait (they do not depend on the kernel before), the rows
    after it."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    eb = tl.program_id(1)
    es = eb * BE + tl.arange(0, BE)
    cols = tl.arange(0, BLOCK_D)
    tmask = t < T
    emask = es < E
    dmask = cols < D
    m2 = tmask[:, None] & dmask[None, :]
    w = tl.load(w_ptr + cols, mask=dmask, other=0.0).to(tl.float32)
    gw = tl.load(gw_ptr + es.to(tl.int64)[:, None] * D + cols[None, :],
                 mask=emask[:, None] & dmask[None, :], other=0.0)  # [BE, BLOCK_D] float32
    pdl_enter(PDL)
    t64 = t.to(tl.int64)
    r = tl.load(x_ptr + t64[:, None] * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    if HAS_RES:
        res = tl.load(res_ptr + t64[:, None] * stride_res + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        r = round_to(r + res, XDT)
    mean_sq = tl.math.div_rn(tl.sum(r * r, axis=1), tl.zeros([BT], tl.float32) + d_float)  # [BT]
    inv = tl.math.div_rn(tl.zeros([BT], tl.float32) + 1.0, tl.math.sqrt_rn(mean_sq + eps))
    n = round_to(r * inv[:, None], XDT)
    y = round_to(w[None, :] * n, YDT)  # [BT, BLOCK_D], the norm's output as stored
    if eb == 0:
        tl.store(y_ptr + t64[:, None] * D + cols[None, :], y, mask=m2)
        if HAS_RES:
            tl.store(r_ptr + t64[:, None] * D + cols[None, :], r, mask=m2)
    lg = tl.sum(y[:, None, :] * gw[None, :, :], axis=2)  # [BT, BE] float32
    if HAS_GB:
        lg += tl.load(gb_ptr + es, mask=emask, other=0.0)[None, :]
    tl.store(out_ptr + t64[:, None] * E + es[None, :], lg, mask=tmask[:, None] & emask[None, :])
    if RANK:  # the block's last program ranks its rows (router_op._gate_topk_kernel's tail)
        tl.debug_barrier()
        tb = tl.program_id(0)
        arrived = tl.atomic_add(sem_ptr + tb, 1, sem="acq_rel", scope="gpu")
        if arrived == NB - 1:
            g, j, e, valid = _row_block(G, GS, BG, BGS)
            for i in tl.static_range(BT):
                ti = (tb * BT + i).to(tl.int64)
                if ti < T:
                    row = tl.load(out_ptr + ti * E + e, mask=valid, other=float("-inf"),
                                  cache_modifier=".cg")
                    _rank_row(row, ti, g, j, e, valid, bias_ptr, ids_ptr, wo_ptr, scaling, G, BG,
                              BGS, A, BA, TOPK_GROUP, SIGMOID, HAS_BIAS, NORM, TOP2)
            tl.atomic_xchg(sem_ptr + tb, 0, sem="relaxed", scope="gpu")


def _router_call(call: NormGateCall) -> RouterCall:
    return RouterCall(None, call.spec, call.bias, call.forced, x=call.x, gate_w=call.gate_w,
                      gate_b=call.gate_b)


def _admit_triton(call: NormGateCall) -> str | None:
    """What the norm's Triton route and the router's gate GEMV each refuse, then the rows a
    program holds: T <= 16, D <= 8192."""
    reason = norm_op._admit_triton(norm_op.NormCall(call.x, call.weight, call.eps, call.residual,
                                                    forced=call.forced))
    if reason is None and call.x.dim() != 2:
        reason = f"x is {call.x.dim()}-D (the kernel reads [T, D] rows)"
    reason = reason or router_op._gemv_refusal(_router_call(call))
    if reason is not None:
        return reason
    T, D = call.x.shape
    if T > MAX_TOKENS:
        return f"{T} tokens > {MAX_TOKENS} (each program normalizes its tokens' whole rows)"
    if D > MAX_D:
        return f"D = {D} > {MAX_D}"
    return None


def _admit_route(call: NormGateCall) -> str | None:
    reason = _admit_triton(call)
    if reason is not None:
        return reason
    if call.spec is None:
        return "no router spec with the call (the caller ranks the logits itself)"
    return router_op._refusal(_router_call(call))


def launch_config(T: int, E: int, D: int) -> dict:
    """2 experts a program (64 programs a token block at E = 128) and up to 4 tokens, at most
    8,192 row elements a program (one token at D = 7168, two at 2880), which stay in
    registers with the two gate rows: for one row of 2048 over 4 warps, 16 float32 a
    thread a row and 32 of gate; 4 rows of 2048 go over 8 warps."""
    block = triton.next_power_of_2(D)
    bt = min(4, triton.next_power_of_2(max(T, 1)), max(1, 8192 // block))
    return dict(BT=bt, BE=2, num_warps=4 if bt * block <= 4096 else 8)


def _launch(call: NormGateCall, rank: bool, config: dict | None = None):
    x, res, w, gw, gb = call.x, call.residual, call.weight, call.gate_w, call.gate_b
    T, D = x.shape
    E = gw.shape[0]
    y = torch.empty(T, D, dtype=torch.promote_types(w.dtype, x.dtype), device=x.device)
    r = x if res is None else torch.empty(T, D, dtype=x.dtype, device=x.device)
    logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, call.spec.top_k, dtype=torch.int32, device=x.device) if rank else None
    wo = torch.empty(T, call.spec.top_k, dtype=torch.float32, device=x.device) if rank else None
    if T == 0:
        return y, r, logits, ids, wo
    cfg = config or launch_config(T, E, D)
    grid = (triton.cdiv(T, cfg["BT"]), triton.cdiv(E, cfg["BE"]))
    if rank:  # the ranking's arguments; without it any pointer stands in (unread)
        bias = logits if call.bias is None else call.bias.float().contiguous()
        sem = semaphore(x.device, grid[0])
        ranks = dict(RANK=True, **_rank_consts(call.spec, E, call.bias is not None))
        scaling = float(call.spec.scaling)
    else:
        bias, sem, ranks, scaling = logits, logits, {}, 1.0
    launch.run(_norm_gate_kernel, grid,
               x, x if res is None else res, w, y, r, gw, gw if gb is None else gb, logits, T, D, E,
               float(D), x.stride(0), x.stride(0) if res is None else res.stride(0), call.eps,
               sem, bias, logits if ids is None else ids, logits if wo is None else wo, grid[1], scaling,
               BT=cfg["BT"], BE=cfg["BE"], BLOCK_D=triton.next_power_of_2(D),
               XDT=DTYPE_CODE[x.dtype], YDT=DTYPE_CODE[y.dtype], HAS_RES=res is not None,
               HAS_GB=gb is not None, num_warps=cfg["num_warps"], **ranks, **launch.pdl_args(x))
    return y, r, logits, ids, wo


def _run_triton(call: NormGateCall, config: dict | None = None):
    return _launch(call, False, config)


def _run_route(call: NormGateCall, config: dict | None = None):
    return _launch(call, True, config)


routes.register("norm_gate", routes.Route("triton_norm_route", routes.MEASURED_NEGATIVE, RECORD, _admit_route,
                                          _run_route))
routes.register("norm_gate", routes.Route("triton_norm_gate", routes.DEFAULT, RECORD, _admit_triton,
                                          _run_triton))
routes.register("norm_gate", routes.Route("unfused", routes.DEFAULT, "reference: rms_norm by its routes, "
                                          "logits by the router's (admits every call)",
                                          lambda call: None, _run_unfused), reference=True, slow=False)


def norm_gate(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
              gate_w: torch.Tensor, gate_b: torch.Tensor | None = None, *,
              spec: RouterSpec | None = None, bias: torch.Tensor | None = None, layer: str = ""):
    """(y, r, logits, ids, w): r = x + residual, y = RMSNorm(r) * weight, logits [T, E] float32
    of y by the float32 gate (or None: the router makes them), ids / w the router's choice
    (or None: the router ranks). Module docstring."""
    return routes.dispatch("norm_gate", NormGateCall(x, weight, eps, residual, gate_w, gate_b, spec, bias),
                           layer)
