"""The `norm_gate` op: the one-launch post-attention norm + gate GEMV (forced through the
registry, on the Triton interpreter) against its reference, the norm op and the float32 gate
GEMM, over odd shapes with NaN-guarded inputs; its refusals; and a model whose serving path
takes it, against the same model on the unfused path.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.kernels import norm_gate_op, norm_op, routes  # noqa: E402
from lowbit.kernels.router_op import gate_logits  # noqa: E402
from lowbit.kernels.runtime import interpreting  # noqa: E402
from tests.kernels.cases import compile_offline, guarded  # noqa: E402
from tests.kernels.test_norm_op import assert_ulp_close  # noqa: E402

EPS = 1e-6
pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")


def _data(T, D, E, dtype, residual, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = guarded((torch.randn(T, D, generator=g) * 3).to(dtype))
    res = guarded(torch.randn(T, D, generator=g).to(dtype)) if residual else None
    w = guarded((1 + 0.2 * torch.randn(D, generator=g)).to(dtype))
    gw = guarded(torch.randn(E, D, generator=g) / D**0.5)
    gb = guarded(torch.randn(E, generator=g)) if bias else None
    return x, w, res, gw, gb


@pytest.mark.parametrize("T,D,E,dtype,residual,bias", [
    (1, 64, 8, torch.bfloat16, True, False),
    (3, 200, 5, torch.bfloat16, True, True),   # D not a power of 2, E odd: masked experts
    (5, 96, 130, torch.float32, False, False),
    (16, 128, 7, torch.float16, True, True),   # four token blocks
])
def test_triton_matches_the_norm_and_the_gate(monkeypatch, T, D, E, dtype, residual, bias):
    x, w, res, gw, gb = _data(T, D, E, dtype, residual, bias, seed=T * 1000 + D)
    monkeypatch.setenv("LOWBIT_ROUTE_NORM_GATE", "triton_norm_gate")
    y, r, logits, ids, wts = norm_gate_op.norm_gate(x, w, EPS, res, gw, gb, layer="t")
    assert ids is None and wts is None  # this route leaves the ranking to the router
    monkeypatch.setenv("LOWBIT_ROUTE_NORM", "torch")
    want_y, want_r = norm_op.rms_norm(x, w, EPS, res)
    if dtype == torch.float32:  # no bf16 rounding absorbs the sum of squares' order: ~1 ulp a row
        torch.testing.assert_close(y, want_y, rtol=1e-6, atol=0)
    else:
        assert_ulp_close(y, want_y)
    assert torch.equal(r, want_r)
    assert logits.shape == (T, E) and logits.dtype == torch.float32
    want = gate_logits(y, gw, gb)  # the gate of the norm's own output
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_unfused_reference_is_todays_path(monkeypatch):
    """On the CPU, unforced (the fused routes are GPU routes), the op is the norm's routes and
    no logits: the router makes them as before."""
    monkeypatch.delenv("LOWBIT_ROUTE_NORM_GATE", raising=False)
    x, w, res, gw, gb = _data(2, 64, 8, torch.bfloat16, True, False, seed=3)
    y, r, logits, ids, wts = norm_gate_op.norm_gate(x, w, EPS, res, gw, gb)
    want_y, want_r = norm_op.rms_norm(x, w, EPS, res)
    assert logits is None and ids is None and wts is None
    assert torch.equal(y, want_y) and torch.equal(r, want_r)
    # DEFAULT from the engine A/B, but a CPU call unforced keeps the unfused path
    assert routes.ops()["norm_gate"].get("triton_norm_gate").status == routes.DEFAULT
    # the engine A/B timed the ranking route slower at B = 1 and 8 (docs/BENCHMARKS.md)
    assert routes.ops()["norm_gate"].get("triton_norm_route").status == routes.MEASURED_NEGATIVE


@pytest.mark.parametrize("T,E,spec,with_bias", [
    (1, 128, dict(top_k=8), False),                       # Qwen3-30B-A3B's router
    (6, 20, dict(top_k=3, norm_topk=False, scaling=2.5), False),  # two token blocks, the last short
    (16, 32, dict(top_k=4, scoring="sigmoid", n_group=4, topk_group=2), True),  # DeepSeek-like
])
def test_the_ranking_route_chooses_as_the_router_does(monkeypatch, T, E, spec, with_bias):
    """triton_norm_route: the same norm and logits, and each token block's last program ranks
    its rows: the ids the router's torch reference picks from the same logits, in the same
    order, and the same weights; the block counters are back to zero after the launch (a
    second launch ranks again)."""
    from lowbit.kernels.router_op import RouterSpec, reference_route

    rs = RouterSpec(**spec)
    x, w, res, gw, gb = _data(T, 64, E, torch.bfloat16, True, False, seed=T + E)
    bias = guarded(torch.rand(E)) if with_bias else None
    monkeypatch.setenv("LOWBIT_ROUTE_NORM_GATE", "triton_norm_route")
    for _ in range(2):
        y, r, logits, ids, wts = norm_gate_op.norm_gate(x, w, EPS, res, gw, gb, spec=rs, bias=bias)
        want_ids, want_w = reference_route(logits, rs, bias)
        assert ids.dtype == torch.int32 and ids.shape == (T, rs.top_k)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(wts, want_w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits, gate_logits(y, gw, gb), rtol=1e-5, atol=1e-5)


def test_the_ranking_route_refuses_what_the_router_refuses():
    from lowbit.kernels.router_op import RouterSpec

    x, w, res, gw, gb = _data(2, 64, 8, torch.bfloat16, True, False, seed=6)
    call = norm_gate_op.NormGateCall
    assert "no router spec" in norm_gate_op._admit_route(call(x, w, EPS, res, gw, gb, forced=True))
    bad = RouterSpec(top_k=9)
    assert "top_k 9" in norm_gate_op._admit_route(call(x, w, EPS, res, gw, gb, bad, forced=True))
    assert norm_gate_op._admit_route(call(x, w, EPS, res, gw, gb, RouterSpec(top_k=2), forced=True)) is None


def test_launch_shapes_keep_a_program_to_8192_row_elements():
    """Wide rows take fewer tokens a program (DeepSeek-V3's 7168 one, gpt-oss's 2880 two), so
    that the normalized rows stay in registers; Qwen3-30B-A3B's 2048 take four."""
    cfg = norm_gate_op.launch_config
    assert cfg(1, 128, 2048) == dict(BT=1, BE=2, num_warps=4)
    assert cfg(16, 128, 2048) == dict(BT=4, BE=2, num_warps=8)
    assert cfg(16, 32, 2880)["BT"] == 2 and cfg(16, 256, 7168)["BT"] == 1
    assert cfg(3, 8, 64)["BT"] == 4 and cfg(2, 8, 64)["BT"] == 2


def test_refusals_name_their_reason():
    x, w, res, gw, gb = _data(17, 64, 8, torch.bfloat16, True, False, seed=4)
    def call(*args):
        return norm_gate_op.NormGateCall(*args, forced=True)

    assert "17 tokens > 16" in norm_gate_op._admit_triton(call(x, w, EPS, res, gw, gb))
    assert "contiguous float32" in norm_gate_op._admit_triton(call(x[:2], w, EPS, res[:2], gw.half(), gb))
    assert "residual" in norm_gate_op._admit_triton(call(x[:2], w, EPS, res[:2].float(), gw, gb))
    big = torch.zeros(1, 16384, dtype=torch.bfloat16)
    assert "D = 16384" in norm_gate_op._admit_triton(
        call(big, torch.ones(16384), EPS, None, torch.zeros(4, 16384), None))
    assert norm_gate_op._admit_triton(call(x[:2], w, EPS, res[:2], gw, gb)) is None


def test_a_moe_model_on_the_fused_route_matches_the_unfused_one(monkeypatch, tiny_moe_dir):
    """A Qwen3-MoE serving forward (prepare_for_serving: the float32 gate the op reads) with
    the norm and the gate in one launch gives the unfused forward's logits: the routing and
    every later op see the same inputs, up to the norm's last-place roundings. The reference
    forward (no prepare_for_serving) never takes the op."""
    from lowbit.checkpoint.loader import load_model
    from lowbit.engine.batch import ForwardBatch

    lm = load_model(str(tiny_moe_dir), dtype="float32", device="cpu").model
    ids = torch.tensor([4, 8, 15, 16, 23])
    with torch.inference_mode():
        routes.reset_counters()
        plain = lm.compute_logits(lm(ids, ForwardBatch.build([5], [0], None)))
        assert not any(c["op"] == "norm_gate" for c in routes.counters()["route_calls"])
        lm.prepare_for_serving()
        outs = {}
        for name in ("unfused", "triton_norm_gate", "triton_norm_route"):
            monkeypatch.setenv("LOWBIT_ROUTE_NORM_GATE", name)
            routes.reset_counters()
            outs[name] = lm.compute_logits(lm(ids, ForwardBatch.build([5], [0], None)))
            calls = [(c["route"], c["count"]) for c in routes.counters()["route_calls"] if c["op"] == "norm_gate"]
            assert sum(n for r, n in calls if r == name) == 2 and len({r for r, _ in calls}) == 1, calls
    torch.testing.assert_close(outs["unfused"], plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["triton_norm_gate"], outs["unfused"], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(outs["triton_norm_route"], outs["unfused"], rtol=1e-3, atol=1e-3)


def test_falling_back_to_the_unfused_path_warns_of_nothing(monkeypatch, caplog):
    """With the fused route on (DEFAULT, as scripts/with_route.py sets it), a call it refuses
    (a prefill's 17 tokens) takes the unfused reference, which is today's fast path: no
    'slow reference' warning, unlike an op whose reference is the torch twin."""
    import logging

    route = routes.ops()["norm_gate"].get("triton_norm_gate")
    monkeypatch.setattr(route, "status", routes.DEFAULT)
    monkeypatch.setattr(routes, "_on_cuda", lambda call: True)
    monkeypatch.delenv("LOWBIT_ROUTE_NORM_GATE", raising=False)
    x, w, res, gw, gb = _data(17, 64, 8, torch.bfloat16, True, False, seed=5)
    with caplog.at_level(logging.WARNING, logger="lowbit"):
        chosen = routes.select("norm_gate", norm_gate_op.NormGateCall(x, w, EPS, res, gw, gb))
    assert chosen.name == "unfused" and "reference route" not in caplog.text
    assert not any(line.startswith("norm_gate") for line in routes.warned_fallbacks())


_COMPILE = """
import json, re, sys
sys.path.insert(0, "scripts")
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lowbit.kernels import norm_gate_op
from lowbit.kernels.norm_op import DTYPE_CODE
from tune_kernels import disassemble
k = norm_gate_op._norm_gate_kernel
from lowbit.kernels.router_op import RouterSpec, _rank_consts
types = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "r_ptr": "*bf16",
         "gw_ptr": "*fp32", "gb_ptr": "*fp32", "out_ptr": "*fp32", "d_float": "fp32", "eps": "fp32",
         "sem_ptr": "*i32", "bias_ptr": "*fp32", "ids_ptr": "*i32", "wo_ptr": "*fp32", "scaling": "fp32"}
out = {}
for T, D, rank in ((1, 2048, False), (16, 2048, False), (16, 7168, False), (1, 2048, True), (16, 2048, True)):
    cfg = norm_gate_op.launch_config(T, 128, D)
    bf = DTYPE_CODE[torch.bfloat16]
    consts = dict(BT=cfg["BT"], BE=cfg["BE"], BLOCK_D=triton.next_power_of_2(D), XDT=bf, YDT=bf,
                  HAS_RES=True, HAS_GB=False, PDL=True)
    consts.update(RANK=rank, **_rank_consts(RouterSpec(top_k=8), 128, False))  # unused without RANK
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in k.arg_names}
    src = ASTSource(fn=k, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(k.arg_names) if n.endswith("_ptr")})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": cfg["num_warps"], "launch_pdl": True})
    res, _ = disassemble(c.asm["cubin"])
    stack = re.search(r"STACK:(\\d+)", res)
    ptx = c.asm["ptx"]
    out[f"{T}x{D}" + ("_rank" if rank else "")] = {"regs": int(re.search(r"REG:(\\d+)", res).group(1)),
                       "stack": int(stack.group(1)) if stack else -1,
                       "waits": ptx.count("griddepcontrol.wait"),
                       "loads_before_wait": len(re.findall(r"ld\\.global", ptx.split("griddepcontrol.wait")[0]))}
print(json.dumps(out))
"""


def test_kernel_compiles_for_sm90_without_spills():
    """The kernel compiles for the H100 / H200's sm_90 on any machine (a process without the
    interpreter) at the engine's shapes, with no register spills and one PDL wait, with
    weight loads (the norm's and the gate rows) requested before it."""
    stats = compile_offline(_COMPILE)
    assert set(stats) == {"1x2048", "16x2048", "16x7168", "1x2048_rank", "16x2048_rank"}
    for shape, st in stats.items():
        assert st["stack"] == 0 and st["regs"] <= 255, (shape, st)
        assert st["waits"] == 1 and st["loads_before_wait"] > 0, (shape, st)
