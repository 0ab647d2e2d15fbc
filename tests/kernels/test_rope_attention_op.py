"""The `rope_attention` op (a decode step's q/k norm + RoPE + KV write, and its attention, in the
decode kernel): the fused route (forced, on the Triton interpreter) against the unfused
reference (the rope op's and the attention op's torch routes), directly through
paged_decode's `rope` over several split counts, inside the demo model's engine, and its
refusals.

Pools hold each sequence's earlier keys and NaN in the row of its new key (and everywhere
unused): the kernel must write that row before it reads it, and no other row. qkv sits
between NaN guards. The reference writes its own copy of the pool; the new rows match it
(bit for bit without qk-norm: the kernel's k is the rope kernel's math) and the outputs
agree to the attention tests' tolerances.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import lowbit  # noqa: E402
from lowbit.errors import LowbitError  # noqa: E402
from lowbit.kernels import attention_op, rope_attention_op, routes  # noqa: E402
from lowbit.kernels.attention import FP8, DecodeRope, KVPool, paged_decode  # noqa: E402
from lowbit.kernels.attention_op import AttentionCall  # noqa: E402
from lowbit.kernels.rope_attention_op import RopeAttentionCall, q_heads, rope_attention  # noqa: E402
from lowbit.kernels.rope_op import RopeCall, rope_cos_sin  # noqa: E402
from lowbit.kernels.runtime import interpreting  # noqa: E402
from lowbit.layers.rope import RotaryEmbedding  # noqa: E402
from tests.kernels.cases import compile_offline, guarded, rel_err  # noqa: E402
from tests.kernels.test_attention import BS, TOL, make_pool  # noqa: E402
from tests.kernels.test_norm_op import assert_ulp_close  # noqa: E402

EPS = 1e-6
P = 256  # rotary table positions
FUSED = "triton_rope_decode"

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on the CPU")


def _case(lens, heads, dtype=torch.bfloat16, kv_dtype=None, norm=True, window=None, sinks=False,
          seed=0):
    """(RopeAttentionCall, new-key rows): sequence b holds lens[b] - 1 earlier keys; its new
    token sits at position lens[b] - 1, whose pool row is NaN."""
    H, Hkv, D = heads
    g = torch.Generator().manual_seed(seed)
    pool, tables = make_pool(lens, Hkv, D, kv_dtype or dtype, dtype, seed=seed)
    last = torch.tensor(lens) - 1
    slots = tables[torch.arange(len(lens)), last // BS].long() * BS + last % BS
    for t in (pool.k, pool.v, pool.k_scale, pool.v_scale):
        if t is not None:
            t.view(torch.uint8)[slots] = 0xFF if t.dtype == FP8 else 0
            if t.dtype != FP8:
                t[slots] = float("nan")
    qkv = guarded((torch.randn(len(lens), (H + 2 * Hkv) * D, generator=g) * 2).to(dtype))
    rot = RotaryEmbedding(D, 10000.0, P)
    cos_sin = rope_cos_sin(rot.inv_freq, rot.attention_scaling, P)
    qw = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype) if norm else None
    kw = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype) if norm else None
    rope = RopeCall(qkv, H, Hkv, D, last, cos_sin, qw, kw, EPS, pool, slots)
    sk = torch.randn(H, generator=g) if sinks else None
    attn = AttentionCall(q_heads(qkv, H, D), pool, tables, torch.tensor(lens, dtype=torch.int32),
                         list(range(len(lens) + 1)), [n - 1 for n in lens], True, D ** -0.5, window, sk)
    return RopeAttentionCall(rope, attn), slots


def _clone(call: RopeAttentionCall) -> RopeAttentionCall:
    """The same call over its own copy of the pool (and of qkv)."""
    p = call.rope.pool
    c = (lambda t: None if t is None else t.clone())
    pool = KVPool(p.k.clone(), p.v.clone(), p.block_size, c(p.k_scale), c(p.v_scale))
    qkv = call.rope.qkv.clone()
    rope = RopeCall(qkv, *[getattr(call.rope, f) for f in ("num_heads", "num_kv_heads", "head_dim",
                    "positions", "cos_sin", "q_weight", "k_weight", "eps")], pool, call.rope.slot_mapping)
    a = call.attn
    attn = AttentionCall(q_heads(qkv, rope.num_heads, rope.head_dim), pool, a.block_tables, a.seq_lens,
                         a.query_start, a.context_lens, True, a.scale, a.window, a.sinks)
    return RopeAttentionCall(rope, attn)


def _run(monkeypatch, route: str, call: RopeAttentionCall) -> torch.Tensor:
    monkeypatch.setenv("LOWBIT_ROUTE_ROPE_ATTENTION", route)
    monkeypatch.delenv("LOWBIT_ROUTE_ROPE", raising=False)
    monkeypatch.delenv("LOWBIT_ROUTE_ATTENTION", raising=False)
    return rope_attention(call, layer="t")


def _check_pools(got: KVPool, ref: KVPool, before: KVPool, slots: torch.Tensor, exact: bool) -> None:
    """Rows `slots` hold the reference's new keys and values; every other row is as before."""
    other = torch.ones(got.k.shape[0], dtype=torch.bool)
    other[slots] = False
    for name in ("k", "v", "k_scale", "v_scale"):
        g, r, b = getattr(got, name), getattr(ref, name), getattr(before, name)
        if g is None:
            continue
        bits = (lambda t: t.view(torch.uint8) if t.dtype == FP8 else t.view(torch.int16 if t.element_size() == 2
                                                                              else torch.int32))
        assert torch.equal(bits(g[other]), bits(b[other])), name
        if exact or name == "v" or g.dtype == FP8:
            assert torch.equal(bits(g[slots]), bits(r[slots])), name
        else:
            assert_ulp_close(g[slots], r[slots])


@pytest.mark.parametrize("heads", [(4, 2, 32), (32, 4, 128)])
@pytest.mark.parametrize("norm", [False, True])
def test_fused_route_matches_unfused(monkeypatch, heads, norm):
    """Default splits (the op's own launch), three sequences, the last key in each one's last
    split."""
    call, slots = _case([1, 17, 40], heads, norm=norm, seed=len(heads) + norm)
    before, ref = _clone(call), _clone(call)
    routes.reset_counters()
    out = _run(monkeypatch, FUSED, call)
    want = _run(monkeypatch, "unfused", ref)
    assert out.shape == (3, heads[0], heads[2]) and not out.float().isnan().any()
    assert rel_err(out, want) < TOL[torch.bfloat16]
    _check_pools(call.rope.pool, ref.rope.pool, before.rope.pool, slots, exact=not norm)
    ran = {(c["op"], c["route"]): c["count"] for c in routes.counters()["route_calls"]}
    assert ran == {("rope_attention", FUSED): 1, ("rope_attention", "unfused"): 1,
                   ("rope", "torch"): 1, ("kv_write", "torch"): 1, ("attention", "torch"): 1}


@pytest.mark.parametrize("splits,fold", [(1, False), (3, False), (5, False), (5, True), (9, True)])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_every_split_count_writes_then_reads_the_new_key(monkeypatch, splits, fold, kv):
    """paged_decode with `rope` at forced split counts and 16-key tiles: the new key's split is
    the first, a middle or the last live one; window and sinks (gpt-oss) on, fp8 pools' codes
    and scales written as the rope kernel writes them; FOLD merges in the last split."""
    lens = [70, 3, 129]
    kv_dtype = FP8 if kv == "fp8" else torch.bfloat16
    call, slots = _case(lens, (6, 1, 64), kv_dtype=kv_dtype, window=50, sinks=True, seed=splits)
    before, ref = _clone(call), _clone(call)
    want = _run(monkeypatch, "unfused", ref)
    r, a = call.rope, call.attn
    out = torch.full_like(want, float("nan"))
    paged_decode(a.q, a.pool, a.block_tables, a.seq_lens, a.scale, a.window, a.sinks, out=out,
                 num_splits=splits, config=dict(BN=16, FOLD=fold),
                 rope=DecodeRope(r.positions, r.cos_sin, r.q_weight, r.k_weight, r.eps, r.slot_mapping))
    assert not out.float().isnan().any()
    assert rel_err(out, want) < TOL[torch.bfloat16], splits
    _check_pools(r.pool, ref.rope.pool, before.rope.pool, slots, exact=False)


def test_float32_and_a_negative_slot(monkeypatch):
    """float32 models (IEEE dots) agree to 1e-5; a sequence whose slot is -1 (the rope
    kernel's padding convention) writes no row, and the others are unaffected."""
    call, slots = _case([9, 33], (4, 2, 32), dtype=torch.float32, seed=3)
    ref = _clone(call)  # the reference writes both rows (the torch route takes no -1)
    call.rope.slot_mapping = slots.clone()
    call.rope.slot_mapping[0] = -1
    out = _run(monkeypatch, FUSED, call)
    want = _run(monkeypatch, "unfused", ref)
    assert rel_err(out[1:], want[1:]) < TOL[torch.float32]
    assert torch.isnan(call.rope.pool.k[slots[0]]).all()  # never written: the row stays NaN
    assert_ulp_close(call.rope.pool.k[slots[1]], ref.rope.pool.k[slots[1]])


def test_refusals(monkeypatch):
    call, _ = _case([5, 7], (4, 2, 32), seed=1)
    call.forced = True
    assert rope_attention_op._admit_triton(call) is None
    partial = _clone(call)
    partial.forced = True
    partial.rope.cos_sin = partial.rope.cos_sin[:, :16].contiguous()
    assert "rope: partial rotary" in rope_attention_op._admit_triton(partial)
    prefill = _clone(call)
    prefill.attn.decode = False
    prefill.forced = True
    assert "attention: not a decode step" in rope_attention_op._admit_triton(prefill)
    contiguous = _clone(call)
    contiguous.rope.pool = None
    contiguous.forced = True
    assert "contiguous cache" in rope_attention_op._admit_triton(contiguous)
    unforced = _clone(call)
    assert "forced route" in rope_attention_op._admit_triton(unforced)
    assert routes.ops()["rope_attention"].get(FUSED).status == routes.MEASURED_NEGATIVE
    monkeypatch.setenv("LOWBIT_ROUTE_ROPE_ATTENTION", FUSED)
    with pytest.raises(LowbitError, match="not a decode step"):
        rope_attention(prefill)
    monkeypatch.delenv("LOWBIT_ROUTE_ROPE_ATTENTION")
    assert routes.select("rope_attention", _clone(call)).name == "unfused"  # CPU, unforced
    assert attention_op.decode_graph_refusal() is None


DEMO = Path(lowbit.__file__).parent / "demo_model"


@pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="the demo model is not installed")
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_demo_greedy_same_with_the_fused_route(monkeypatch, kv):
    """The demo model's engine with the fused route forced: its decode steps run it (prefill
    and mixed steps keep the rope and attention ops), and greedy tokens equal the unfused
    engine's (float32 on the CPU; a float32 or an fp8 KV pool)."""
    from lowbit import LLM, SamplingParams

    prompts = ["It is a truth", "HAMLET.\nTo be, or not"]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    monkeypatch.delenv("LOWBIT_ROUTE_ROPE_ATTENTION", raising=False)
    llm = LLM("demo", kv_cache_tokens=256, max_num_batched_tokens=64, kv_cache_dtype=kv)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    monkeypatch.setenv("LOWBIT_ROUTE_ROPE_ATTENTION", FUSED)
    routes.reset_counters()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    ran = {c["route"]: c["count"] for c in routes.counters()["route_calls"] if c["op"] == "rope_attention"}
    assert set(ran) == {FUSED} and ran[FUSED] > 0


_COMPILE = """
import json, re, sys
sys.path.insert(0, "scripts")
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lowbit.kernels import attention
from lowbit.kernels.norm_op import DTYPE_CODE
from tune_kernels import disassemble
k = attention._decode_split_kernel
bf = DTYPE_CODE[torch.bfloat16]
out = {}
for rope in (False, True):
    for fp8 in (False, True):
        cfg = {**attention.DECODE_CFG, **(attention.FP8_DECODE_CFG if fp8 else {})}
        consts = dict(G=8, GP=16, D=128, BD=128, BS=16, BN=cfg["BN"], DIRECT=False, FOLD=False,
                      FP8=fp8, HAS_WINDOW=False, HAS_SINKS=False, IEEE=False, WORDS=fp8, ASM=True,
                      PDL=True, ROPE=rope, BHALF=64, DT=bf, NDT=bf, HAS_NORM=True, RECIP=True)
        kv = "*fp8e4nv" if fp8 else "*bf16"
        types = {"q_ptr": "*bf16", "k_ptr": kv, "v_ptr": kv, "ks_ptr": "*fp32", "vs_ptr": "*fp32",
                 "bt_ptr": "*i32", "lens_ptr": "*i32", "sinks_ptr": "*i32", "out_ptr": "*bf16",
                 "part_ptr": "*fp32", "ml_ptr": "*fp32", "sem_ptr": "*i32", "qk_scale": "fp32",
                 "pos_ptr": "*i64", "cs_ptr": "*fp32", "qw_ptr": "*bf16", "kw_ptr": "*bf16",
                 "slot_ptr": "*i64", "eps": "fp32"}
        sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in k.arg_names}
        src = ASTSource(fn=k, signature=sig, constexprs=consts,
                        attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(k.arg_names) if n.endswith("_ptr")})
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
                                    "launch_pdl": True})
        res, _ = disassemble(c.asm["cubin"])
        stack = re.search(r"STACK:(\\d+)", res)
        out[f"{'rope' if rope else 'plain'}_{'fp8' if fp8 else 'bf16'}"] = {
            "regs": int(re.search(r"REG:(\\d+)", res).group(1)),
            "stack": int(stack.group(1)) if stack else 0,
            "waits": c.asm["ptx"].count("griddepcontrol.wait")}
print(json.dumps(out))
"""


def test_rope_decode_kernel_compiles_for_sm90():
    """The ROPE split kernel compiles for the H100 / H200's sm_90 on any machine (a process
    without the interpreter) at the Qwen3-30B-A3B heads, bf16 and fp8 pools, with one PDL
    wait, and spills no more than the plain kernel of the same config (the shipped bf16
    config already keeps 152 bytes on the stack; the fp8 one none)."""
    st = compile_offline(_COMPILE)
    for kv in ("bf16", "fp8"):
        rope, plain = st[f"rope_{kv}"], st[f"plain_{kv}"]
        assert rope["waits"] == 1 and rope["regs"] <= 255, (kv, rope)
        assert rope["stack"] <= plain["stack"], (kv, rope, plain)
    assert st["rope_fp8"]["stack"] == 0
