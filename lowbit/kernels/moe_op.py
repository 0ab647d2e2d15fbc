"""The `moe` op: routed experts y[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t]) through routes.

Shape legend: T tokens, H hidden, I expert width, E experts, A top-k.
expert_e(x) = W2_e act(W13_e x + b13_e) + b2_e: the biases b13 [E, 2I] and b2 [E, H] are
optional, act is a MoeActivation (SiLU-gate, or gpt-oss's clamped SwiGLU); every route
below takes them, except the hybrid layouts (refused: see moe_experts).
Routes, in selection order (status and record in docs/ROUTES.md):
  triton_moe_shared_slots   (MEASURED_NEGATIVE: 1.08-1.30x slower than the routed route + the
                            shared MLP at DeepSeek-V3 C1-C16, H200) a block with shared
                            experts (SharedMLP) whose routed and shared
                            weights form one LUT layout: the shared MLP rides in the routed
                            launch as n_shared extra experts of weight 1.0 (decode tiles for
                            T <= 16 and <= 256 slots, grouped tiles above); its refusal is why
                            a block does not fuse, and every later route then runs the routed
                            experts and the shared MLP one after the other
  triton_tc_moe             nvfp4 experts (SiLU, no biases), T <= 64 tokens, bf16 activations:
                            tensor-core GEMVs (lowbit.kernels.tc_moe) per slot, or from the
                            device config's GROUPED_FROM tokens per expert (each expert read
                            once for all its tokens)
  triton_vq_moe             (OPT_IN: block kernels not yet timed) vector codebook stacks (vq2 / vq3 /
                            vq4, SiLU, no biases), T <= 64 tokens: per-slot CUDA-core GEMVs
                            over the codebook (lowbit.kernels.vq_moe), three launches,
                            graph-safe; without it vq experts run the torch route
  triton_moe_dense_shared   (OPT_IN: no GPU record yet) the decode route's per-slot gemv with a
                            block's merged dense shared MLP (DeepSeek bf16 after
                            prepare_for_serving) as n_shared more slots of every token at
                            weight 1.0, read in place (moe_layout.DenseShared): two launches
  triton_fused_moe_decode   T <= 16 tokens (nvfp4: 32), T * A <= 256 slots: LUT / fp8 / bf16
                            experts as per-slot GEMVs (expert id read on the device) while
                            slots < 2 E (fewer than two tokens per expert on average; nvfp4:
                            every T it admits); otherwise, and for
                            fp16 / fp32 experts, tensor-core tiles per expert found in-kernel
                            (crossover measured: docs/BENCHMARKS.md#kernels)
  triton_moe_grouped        device sort by expert, grouped GEMM with decode in the main loop
  torch                     reference: loop over the experts used (host read), float32
A hybrid layout (lowbit.kernels.moe_hybrid.HybridExperts: two formats and / or shared
experts, passed as w13 with w2=None) takes the same routes: the decode route runs its tiles
(no per-slot GEMV variant yet), the grouped route its grouped tiles, torch its twin.
HybridTensor stacks with expert biases or the clamped SwiGLU run the torch route only: its
reference runs each part's experts (reference_moe) and sums them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.formats.views import DenseWeight, LutWeight
from lowbit.kernels import launch, routes
from lowbit.kernels.dequant_gemm import gemv_refusal
from lowbit.kernels.moe import (
    SILU,
    MoeActivation,
    bias_refusal,
    dense_shared_refusal,
    fused_moe,
    fused_moe_gemv,
    moe_fmt_keys,
    moe_refusal,
    reference_moe,
)
from lowbit.kernels.moe_hybrid import fused_moe_hybrid, reference_hybrid
from lowbit.kernels.moe_layout import (
    DenseShared,
    HybridExperts,
    HybridTensor,
    SharedMLP,
    layout_of,
    with_shared_slots,
)
from lowbit.kernels.moe_slots import SlotSum
from lowbit.kernels.runtime import fp8_refusal, triton_refusal
from lowbit.kernels.tc_moe import tc_moe_gemv, tc_moe_grouped, tc_moe_refusal
from lowbit.kernels.vq_moe import vq_moe, vq_moe_refusal
from lowbit.kernels.weights import DECODE_E2M1, Resolved, resolve

BENCH = "docs/BENCHMARKS.md#kernels"
DECODE_MAX_TOKENS = 16
DECODE_MAX_SLOTS = 256
# nvfp4 experts (E2M1 codes, e4m3 scales) keep the per-slot gemv up to 32 tokens: H200,
# Qwen3-30B-A3B, C32 gemv 380 us against grouped tiles 512 (docs/BENCHMARKS.md#kernels,
# "Batched decode"); at C64 the tiles win (558 against 751), and int4 g128 keeps the tiles
# from C32 (435 against 493)
E2M1_GEMV_MAX_TOKENS = 32
# the tensor-core nvfp4 MoE: per slot or expert-grouped up to 64 tokens (H200, Qwen3-30B-A3B,
# C64 150 us expert-grouped against 539 for the grouped tiles), and expert-grouped up to 512
# where the device config names a grouped schedule for the shape (C128 / C512: 205 / 428 us
# with 16 / 32 slots a tile, against 561 / 578 for the tiles; engine pp512 19.2 k -> 21.4 k
# tok/s; docs/BENCHMARKS.md#kernels, "Tensor-core nvfp4 gemv"). Above 512 the grouped tiles:
# at 2,048-token prefill chunks the two are level in the engine (1,174 against 1,179 us a
# layer), though the kernel A/B had 1,269 against 1,450
TC_MOE_PER_SLOT_MAX_TOKENS = 64
TC_MOE_MAX_TOKENS = 512


@dataclass
class MoeCall:
    x: torch.Tensor  # [T, H]
    ids: torch.Tensor  # [T, A] int32
    weights: torch.Tensor  # [T, A] float32
    w13: Resolved | HybridExperts | HybridTensor  # [E, 2I, H], or the whole hybrid layout
    w2: Resolved | HybridTensor | None  # [E, H, I]; None with a hybrid layout
    forced: bool = False
    b13: torch.Tensor | None = None  # [E, 2I]
    b2: torch.Tensor | None = None  # [E, H]
    activation: MoeActivation = SILU
    num_experts: int | None = None  # the model's E when w13 stacks fewer slots (expert cache)
    out: torch.Tensor | None = None  # [T, H] x.dtype or float32: where y is written
    shared: SharedMLP | None = None  # the block's shared experts, added to y
    defer: bool = False  # a route that ends in the combine launch may return a SlotSum

    @property
    def experts(self) -> int:
        """E for the gemv-or-tiles rule: the model's expert count, not the stack's, so that
        an expert cache's slot stack runs the same kernels (and roundings) as the model."""
        return self.num_experts or self.w13.lead[0]

    def config(self, kernel: str) -> dict | None:
        """The launch config tuned for the model's E (the launchers would key it by the slot
        stack's E), or None to let the launcher look it up."""
        if self.num_experts is None:
            return None
        return launch.lookup(kernel, moe_fmt_keys(self.w13), self.num_experts, self.x.shape[1],
                             self.x.shape[0])


def _refusal(call: MoeCall) -> str | None:
    reason = triton_refusal(call.x, call.forced)
    if reason is not None:
        return reason
    if call.x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations are {call.x.dtype}"
    if call.ids.dtype not in (torch.int32, torch.int64):
        return f"topk_ids are {call.ids.dtype}, not int32/int64"
    if isinstance(call.w13, HybridTensor):
        return "hybrid stacks with expert biases or the clamped SwiGLU: no kernel takes them"
    if isinstance(call.w13, HybridExperts):
        return _layout_refusal(call.x, call.w13)
    return (fp8_refusal(call.x, call.w13, call.w2) or moe_refusal(call.x, call.w13, call.w2)
            or bias_refusal(call.x, call.w13, call.w2, call.b13, call.b2))


def _layout_refusal(x: torch.Tensor, layout: HybridExperts) -> str | None:
    if x.shape[1] != layout.hidden:
        return f"x has {x.shape[1]} columns, the experts {layout.hidden}"
    return fp8_refusal(x, *(w for g in layout.groups for w in (g.w13, g.w2)))


def _admit_shared(call: MoeCall) -> str | None:
    """Whether the shared experts ride in the routed launch; the reason is why they do not."""
    if call.shared is None:
        return "no shared experts"
    reason = triton_refusal(call.x, call.forced)
    if reason is not None:
        return reason
    if call.b13 is not None or call.b2 is not None or call.activation.kind != "silu":
        return "expert biases or the clamped SwiGLU: the hybrid kernels take neither"
    if not isinstance(call.w13, (LutWeight, HybridExperts)):
        return f"routed experts are {type(call.w13).__name__}: shared slots need LUT weights"
    layout = call.shared.fused(call.w13, call.w2)
    if isinstance(layout, str):
        return layout
    if call.x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations are {call.x.dtype}"
    if call.ids.dtype not in (torch.int32, torch.int64):
        return f"topk_ids are {call.ids.dtype}, not int32/int64"
    return _layout_refusal(call.x, layout)


def _run_shared(call: MoeCall) -> torch.Tensor:
    layout = call.shared.fused(call.w13, call.w2)
    routed = call.w13.num_experts if isinstance(call.w13, HybridExperts) else call.w13.lead[0]
    ids, weights = with_shared_slots(call.ids, call.weights, routed, layout.num_experts - routed)
    t, a = ids.shape  # [T, A + n_shared]
    decode = t <= DECODE_MAX_TOKENS and t * a <= DECODE_MAX_SLOTS
    return fused_moe_hybrid(call.x, ids, weights, layout, mode="decode" if decode else "grouped")


def _then_shared(run):
    """A route's run followed by the shared MLP on its own (the shared route refused)."""
    def run_both(call: MoeCall) -> torch.Tensor | SlotSum:
        y = run(call)
        if call.shared is None:
            return y
        if isinstance(y, SlotSum):  # the next norm adds the shared MLP's output after the sum
            y.extra = call.shared.mlp(call.x)
            return y
        return y + call.shared.mlp(call.x)

    return run_both


def _nvfp4_gemv(call: MoeCall) -> bool:
    """Both stacks E2M1 with e4m3 block scales (nvfp4), for E2M1_GEMV_MAX_TOKENS."""
    return all(isinstance(w, LutWeight) and w.decode == DECODE_E2M1 and w.view.scale_kind == "e4m3"
               for w in (call.w13, call.w2))


def _admit_decode(call: MoeCall) -> str | None:
    t, a = call.ids.shape
    limit = E2M1_GEMV_MAX_TOKENS if _nvfp4_gemv(call) else DECODE_MAX_TOKENS
    if t > limit or t * a > DECODE_MAX_SLOTS:
        return f"{t} tokens x top-{a}: the decode route takes <= {limit} tokens, <= {DECODE_MAX_SLOTS} slots"
    reason = _refusal(call)
    if reason is None and not isinstance(call.w13, (DenseWeight, HybridExperts)):
        reason = gemv_refusal(call.x[:1], call.w13) or gemv_refusal(call.x[:1], call.w2)
    if reason is None and isinstance(call.w13, DenseWeight) and call.x.dtype == torch.float32:
        reason = "tensor-core tiles read bf16/fp16 activations, got float32"
    return reason


DENSE_GEMV_MAX_WEIGHTS = 1 << 24  # per expert FC1 (2I x H); measured crossover below


def _gemv_fits(call: MoeCall) -> bool:
    """Whether both expert stacks take the per-slot gemv: LUT / fp8 always (once admitted);
    bf16 experts with whole 32-bit words and at most 2**24 FC1 weights per expert. H200
    (docs/BENCHMARKS.md#kernels): Qwen3-30B-A3B (3.1 M) gemv 27.7 against tiles 35.1 us at
    C1; DeepSeek-V3 (29 M) even; Mixtral (117 M) 246 against 204 us: the tiles keep it."""
    x1, w13 = call.x[:1], call.w13
    if isinstance(w13, DenseWeight) and w13.n * w13.kp > DENSE_GEMV_MAX_WEIGHTS:
        return False
    return gemv_refusal(x1, w13) is None and gemv_refusal(x1, call.w2) is None


def _use_gemv(call: MoeCall, slots_a_token: int) -> bool:
    """The decode route's choice of per-slot GEMVs over tiles (see _gemv_fits)."""
    t = call.ids.shape[0]
    few = t * slots_a_token < 2 * call.experts or (t > DECODE_MAX_TOKENS and _nvfp4_gemv(call))
    return few and _gemv_fits(call)


def _dense_shared(call: MoeCall) -> DenseShared | None:
    """The block's shared MLP as extra slots of the routed gemv launches (dense experts), or
    None: then it runs on its own after the routed experts (_then_shared)."""
    if call.shared is None or isinstance(call.w13, (HybridExperts, HybridTensor)):
        return None
    if call.b13 is not None or call.b2 is not None or call.activation.kind != "silu" or call.out is not None:
        return None
    sh = call.shared.dense(call.w13.n // 2)
    if sh is None or dense_shared_refusal(call.w13, call.w2, sh) is not None:
        return None
    return sh


def _run(mode: str):
    def run(call: MoeCall) -> torch.Tensor:
        if isinstance(call.w13, HybridExperts):
            return fused_moe_hybrid(call.x, call.ids, call.weights, call.w13, mode=mode)
        extra = dict(b13=call.b13, b2=call.b2, activation=call.activation, out=call.out)
        if mode == "decode" and _use_gemv(call, call.ids.shape[1]):
            return fused_moe_gemv(call.x, call.ids, call.weights, call.w13, call.w2,
                                  config=call.config("moe_gemv"), **extra)
        return fused_moe(call.x, call.ids, call.weights, call.w13, call.w2, mode=mode,
                         config=call.config(f"moe_{mode}"), defer=call.defer, **extra)

    return run


def _admit_dense_shared(call: MoeCall) -> str | None:
    if call.shared is None:
        return "no shared experts"
    reason = _admit_decode(call)
    if reason is not None:
        return reason
    sh = _dense_shared(call)
    if sh is None:
        return ("the shared MLP is not a merged dense gate_up / down pair of the routed stacks' "
                "dtype (quantized, or not prepared for serving)")
    if not _use_gemv(call, call.ids.shape[1] + sh.n):
        return "the decode route's tiles, not its per-slot gemv, at this many slots"
    return None


def _run_dense_shared(call: MoeCall) -> torch.Tensor:
    """Routed and shared experts in the two gemv launches (DeepSeek bf16: 2 launches a layer
    where the shared MLP on its own takes 5: gate_up, SiLU-mul, down and its split-K
    reduce, the add)."""
    return fused_moe_gemv(call.x, call.ids, call.weights, call.w13, call.w2,
                          config=call.config("moe_gemv"), shared=_dense_shared(call))


def _run_torch(call: MoeCall) -> torch.Tensor:
    if isinstance(call.w13, HybridExperts):
        return reference_hybrid(call.x, call.ids, call.weights, call.w13)
    if isinstance(call.w13, HybridTensor):
        return _reference_parts(call)
    # the reference computes in float32 from x.float() and rounds once at the end
    x = call.x if call.out is None else call.x.to(call.out.dtype)
    y = reference_moe(x, call.ids, call.weights, call.w13, call.w2, b13=call.b13,
                      b2=call.b2, activation=call.activation)
    return y if call.out is None else call.out.copy_(y)


def _reference_parts(call: MoeCall) -> torch.Tensor:
    """The torch route for HybridTensor stacks: reference_moe over each part's stacks, the
    entries of the other parts weighted 0 (skipped), summed in float32."""
    w13, w2, x = call.w13, call.w2, call.x.float()
    ids = call.ids.long()  # [T, A]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for part, members in w13.members.items():
        m = torch.tensor(members, device=x.device)
        local = torch.zeros(w13.shape[0], dtype=torch.int64, device=x.device)
        local[m] = torch.arange(len(members), device=x.device)
        mine = torch.zeros(w13.shape[0], dtype=torch.bool, device=x.device)
        mine[m] = True
        weights = torch.where(mine[ids], call.weights.float(), 0.0)
        out += reference_moe(x, local[ids], weights, resolve(w13.parts[part]), resolve(w2.parts[part]),
                             b13=None if call.b13 is None else call.b13[m],
                             b2=None if call.b2 is None else call.b2[m], activation=call.activation)
    return out.to(call.x.dtype)


routes.register("moe", routes.Route(
    "triton_moe_shared_slots", routes.MEASURED_NEGATIVE,
    BENCH + " (H200, DeepSeek-V3 nvfp4, moe_mixed rows: 540 / 1,938 / 6,892 us at C1 / C4 / C16 "
    "against 423 / 1,488 / 6,363 for the routed launch + the shared MLP as three gemvs)",
    _admit_shared, _run_shared))


def _tc_config(call: MoeCall) -> dict:
    return launch.lookup("tc_moe", "nvfp4", call.experts, call.x.shape[1], call.x.shape[0])


def _admit_tc(call: MoeCall) -> str | None:
    t = call.ids.shape[0]
    if t > TC_MOE_MAX_TOKENS:
        return f"{t} tokens > {TC_MOE_MAX_TOKENS}: the grouped tiles"
    if t > TC_MOE_PER_SLOT_MAX_TOKENS and t < _tc_config(call).get("GROUPED_FROM", 1 << 30):
        return (f"{t} tokens > {TC_MOE_PER_SLOT_MAX_TOKENS} and no expert-grouped schedule is "
                "tuned for this shape on this device: the grouped tiles")
    if isinstance(call.w13, (HybridExperts, HybridTensor)):
        return "hybrid layouts: the hybrid kernels take them"
    return _refusal(call) or tc_moe_refusal(call.x, call.w13, call.w2, call.activation,
                                            call.b13, call.b2)


def _run_tc(call: MoeCall) -> torch.Tensor:
    """Per-slot, or expert-grouped from the token count the device's tuned config names
    ("GROUPED_FROM"; absent: per-slot at every T the route admits)."""
    t = call.x.shape[0]
    cfg = _tc_config(call)
    if t >= cfg.get("GROUPED_FROM", 1 << 30):
        return tc_moe_grouped(call.x, call.ids, call.weights, call.w13, call.w2,
                              config=cfg.get("grouped"), out=call.out, defer=call.defer)
    return tc_moe_gemv(call.x, call.ids, call.weights, call.w13, call.w2, config=cfg,
                       out=call.out)


routes.register("moe", routes.Route(
    "triton_tc_moe", routes.DEFAULT,
    BENCH + " (H200, Qwen3-30B-A3B nvfp4, per slot C1 / C4: 17 / 42 us against 19 / 56 for the "
    "CUDA-core gemv; expert-grouped C8 / C16 / C32 / C64: 71 / 103 / 132 / 150 us against 77 / "
    "127 / 237 / 454 per slot, and 539 for the grouped tiles at C64; C128 / C512: 205 / 428 us "
    "against 561 / 578 for the grouped tiles)", _admit_tc,
    _then_shared(_run_tc)))
def _admit_vq(call: MoeCall) -> str | None:
    reason = triton_refusal(call.x, call.forced)
    if reason is not None:
        return reason
    if isinstance(call.w13, (HybridTensor, HybridExperts)):
        return "hybrid expert layouts: the vq kernels take one vq stack for w13 and one for w2"
    if call.x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations are {call.x.dtype}"
    if call.ids.dtype not in (torch.int32, torch.int64):
        return f"topk_ids are {call.ids.dtype}, not int32/int64"
    if call.b13 is not None or call.b2 is not None or call.activation.kind != "silu":
        return "expert biases or the clamped SwiGLU: the vq kernels take SiLU experts only"
    return vq_moe_refusal(call.x, call.ids, call.w13, call.w2)


def _run_vq(call: MoeCall) -> torch.Tensor:
    return vq_moe(call.x, call.ids, call.weights, call.w13, call.w2, out=call.out)


routes.register("moe", routes.Route(
    "triton_vq_moe", routes.OPT_IN,
    "H100 (call series 7c30aaf-9cea5a0), first packed form: Qwen3-30B-A3B layer at T = 1 222 us "
    "(vq3), about 10x nvfp4; the block kernels that replaced it (5.0-6.7 lane instructions a "
    "weight offline, from 24-30) are not yet timed: python scripts/bench_vq_gemv.py --moe",
    _admit_vq, _then_shared(_run_vq)))
routes.register("moe", routes.Route(
    "triton_moe_dense_shared", routes.OPT_IN,
    "none yet: the shared MLP as extra slots of the decode route's gemv (DeepSeek bf16), checked "
    "against the torch route in tests/kernels/test_moe_shared.py and tests/gpu/test_moe_shared_gpu.py; "
    "the engine A/B (bench latency --variant shared=moe:triton_moe_dense_shared) is to be taken",
    _admit_dense_shared, _run_dense_shared))
routes.register("moe", routes.Route(
    "triton_fused_moe_decode", routes.DEFAULT,
    BENCH + " (Qwen3-30B-A3B and Mixtral C1-C16: 22-1476 us, 2-277x the torch bf16 expert "
    "loop except Mixtral C16 nvfp4, 0.96x; nvfp4 C32: 380 us against 512 for the grouped tiles)", _admit_decode,
    _then_shared(_run("decode"))))
routes.register("moe", routes.Route(
    "triton_moe_grouped", routes.DEFAULT,
    "docs/BENCHMARKS.md#decode-graph (batched decode and prefill through the engine; the torch "
    "loop reads expert ids on the host, so it cannot be captured)", _refusal, _then_shared(_run("grouped"))))
routes.register("moe", routes.Route(
    "torch", routes.DEFAULT, "reference (admits every call)", lambda call: None,
    _then_shared(_run_torch)), reference=True)


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13, w2,
                *, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                activation: MoeActivation | None = None, num_experts: int | None = None,
                out: torch.Tensor | None = None, shared: SharedMLP | None = None,
                defer: bool = False, layer: str = "") -> torch.Tensor | SlotSum:
    """y [T, H] in x.dtype. See lowbit.kernels for the contract; w13 may also be a
    HybridExperts layout (then w2 is None and the ids index its experts), or w13 and w2
    HybridTensor stacks (quantized per expert group), turned into a layout once. A layout
    takes neither expert biases nor an activation other than SiLU (ValueError); HybridTensor
    stacks with them run the torch route. num_experts: the model's expert count when w13 /
    w2 stack only some of them (an expert cache's slots), so that the route picks the kernels
    and launch configs it would pick for the model. out: [T, H] in x.dtype or float32 (not
    with hybrid layouts or shared experts), written instead of a new tensor; float32 keeps y
    unrounded (an expert cache sums groups of experts). shared: the block's shared experts,
    added to y; the routes decide whether they ride in the routed launch. defer: a route
    whose last launch would be the combine may return a moe_slots.SlotSum instead, for the
    next RMSNorm to sum (not with out; shared experts' output rides along as its extra)."""
    activation = SILU if activation is None else activation
    extras = b13 is not None or b2 is not None or activation.kind != "silu"
    assert out is None or shared is None, "shared experts are added to a new tensor"
    if isinstance(w13, (HybridTensor, HybridExperts)):
        assert out is None, "hybrid layouts write a new tensor"
        if extras and isinstance(w13, HybridExperts):
            raise ValueError("hybrid expert layouts take no expert biases and only the SiLU "
                             "activation; pass the HybridTensor stacks (the torch route runs "
                             "them) or keep such experts in one format per stack")
        if isinstance(w13, HybridTensor) and extras:
            _check_stacks(w13, w2, b13, b2)
        elif isinstance(w13, HybridTensor):
            w13, w2 = layout_of(w13, w2), None
        call = MoeCall(x, topk_ids, topk_weights, w13, w2, b13=b13, b2=b2, activation=activation,
                       shared=shared)
        return routes.dispatch("moe", call, layer)
    call = MoeCall(x, topk_ids, topk_weights, resolve(w13), resolve(w2), b13=b13, b2=b2,
                   activation=activation, num_experts=num_experts, out=out, shared=shared,
                   defer=defer and out is None)
    reason = bias_refusal(x, call.w13, call.w2, b13, b2)
    if reason is not None:
        raise ValueError(f"moe_experts: {reason}")
    return routes.dispatch("moe", call, layer)


def _check_stacks(w13: HybridTensor, w2: HybridTensor, b13: torch.Tensor | None,
                  b2: torch.Tensor | None) -> None:
    if not isinstance(w2, HybridTensor) or w13.members != w2.members:
        raise ValueError("hybrid w13 and w2 must both be HybridTensor stacks that split the "
                         "experts the same way")
    for name, b, n in (("b13", b13, w13.shape[1]), ("b2", b2, w2.shape[1])):
        if b is not None and tuple(b.shape) != (w13.shape[0], n):
            raise ValueError(f"moe_experts: {name} is {list(b.shape)}, expected [{w13.shape[0]}, {n}]")
