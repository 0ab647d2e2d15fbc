"""The decode kernel that does the rope op's work (lowbit.kernels.rope_attention_op, route
triton_rope_decode) on a CUDA GPU: against the rope kernel + decode kernel pair at the
Qwen3-30B-A3B heads and an odd shape, bf16 and fp8 pools, the device's own split count (the
new key in any of dozens of splits), and replayed in a CUDA graph with fresh inputs.

Pools are NaN outside the rows a sequence's earlier keys fill, including the new key's row:
the kernel must write it before its loads read it back (a CTA barrier between them)."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels import rope_attention_op
from lowbit.kernels.attention import FP8, KVPool, reference_kv_write
from lowbit.kernels.attention_op import AttentionCall
from lowbit.kernels.rope_attention_op import RopeAttentionCall, q_heads
from lowbit.kernels.rope_op import RopeCall, rope_cos_sin

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"
BS = 16
P = 40000


def _case(lens, heads, kv_dtype, seed, sinks=False, window=None):
    H, Hkv, D = heads
    g = torch.Generator(device=DEV).manual_seed(seed)
    need = [-(-n // BS) for n in lens]
    blocks = sum(need) + 2
    rows = (blocks + 1) * BS
    fp8 = kv_dtype == FP8
    nan = (lambda *s: torch.full(s, float("nan"), device=DEV))
    pool = KVPool(nan(rows, Hkv, D).to(kv_dtype), nan(rows, Hkv, D).to(kv_dtype), BS,
                  nan(rows, Hkv) if fp8 else None, nan(rows, Hkv) if fp8 else None)
    order = torch.randperm(blocks, device=DEV, generator=g)
    width = max(need) + 3  # the table is wider than any sequence (graphs pad it)
    tables = torch.full((len(lens), width), blocks, dtype=torch.int32, device=DEV)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[at:at + n].int()
        at += n
    for b, n in enumerate(lens):  # the earlier keys; the new key's row stays NaN
        pos = torch.arange(n - 1, device=DEV)
        slots = tables[b][pos // BS].long() * BS + pos % BS
        reference_kv_write(torch.randn(n - 1, Hkv, D, device=DEV, generator=g).bfloat16(),
                           torch.randn(n - 1, Hkv, D, device=DEV, generator=g).bfloat16(), pool, slots)
    last = torch.tensor(lens, device=DEV) - 1
    slots = tables[torch.arange(len(lens), device=DEV), last // BS].long() * BS + last % BS
    qkv = (torch.randn(len(lens), (H + 2 * Hkv) * D, device=DEV, generator=g) * 2).bfloat16()
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    cos_sin = rope_cos_sin(inv, 1.0, P)
    qw = (1 + 0.2 * torch.randn(D, device=DEV, generator=g)).bfloat16()
    kw = (1 + 0.2 * torch.randn(D, device=DEV, generator=g)).bfloat16()
    rope = RopeCall(qkv, H, Hkv, D, last, cos_sin, qw, kw, 1e-6, pool, slots)
    sk = torch.randn(H, device=DEV, generator=g) if sinks else None
    attn = AttentionCall(q_heads(qkv, H, D), pool, tables, torch.tensor(lens, dtype=torch.int32, device=DEV),
                         list(range(len(lens) + 1)), [n - 1 for n in lens], True, D ** -0.5, window, sk)
    return RopeAttentionCall(rope, attn), slots


def _copy(call: RopeAttentionCall) -> RopeAttentionCall:
    p = call.rope.pool
    c = (lambda t: None if t is None else t.clone())
    pool = KVPool(p.k.clone(), p.v.clone(), BS, c(p.k_scale), c(p.v_scale))
    r, a = call.rope, call.attn
    rope = RopeCall(r.qkv, r.num_heads, r.num_kv_heads, r.head_dim, r.positions, r.cos_sin, r.q_weight,
                    r.k_weight, r.eps, pool, r.slot_mapping)
    attn = AttentionCall(a.q, pool, a.block_tables, a.seq_lens, a.query_start, a.context_lens, True,
                         a.scale, a.window, a.sinks)
    return RopeAttentionCall(rope, attn)


def _unfused(call: RopeAttentionCall) -> torch.Tensor:
    """The rope kernel, then the decode kernel: today's two routes, called directly."""
    from lowbit.kernels import attention_op, rope_op

    q, k, v = rope_op._run_triton(call.rope)
    return attention_op._run_decode(AttentionCall(q, *[getattr(call.attn, f) for f in (
        "pool", "block_tables", "seq_lens", "query_start", "context_lens", "decode", "scale",
        "window", "sinks")]))


def _check(call, ref, out, want, slots):
    assert torch.isfinite(out.float()).all()
    err = (out.float() - want.float()).abs().max().item()
    assert err <= 2e-2 * want.float().abs().max().item(), err
    for name in ("k", "v", "k_scale", "v_scale"):
        got, exp = getattr(call.rope.pool, name), getattr(ref.rope.pool, name)
        if got is None:
            continue
        bits = (lambda t: t.view(torch.uint8) if t.dtype == FP8 else t.float())
        g, e = bits(got[slots]), bits(exp[slots])
        if name == "v" or got.dtype == FP8:  # the same math: byte for byte but for fp8 k's norm order
            same = (g == e) | (torch.isnan(g) & torch.isnan(e)) if g.is_floating_point() else g == e
            assert same.float().mean().item() > 0.99, name
        else:
            torch.testing.assert_close(g, e, rtol=2e-2, atol=1e-2)
        other = torch.ones(got.shape[0], dtype=torch.bool, device=DEV)
        other[slots] = False
        a, b = bits(got[other]), bits(exp[other])
        assert ((a == b) | (torch.isnan(a) & torch.isnan(b))).all(), name


@pytest.mark.parametrize("heads", [(32, 4, 128), (12, 2, 64)])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("lens", [[576], [1, 17, 300, 4097, 33, 5000, 9, 64]])
def test_fused_matches_rope_then_decode(heads, kv, lens):
    kv_dtype = FP8 if kv == "fp8" else torch.bfloat16
    call, slots = _case(lens, heads, kv_dtype, seed=len(lens) + heads[0], sinks=heads[0] == 12,
                        window=300 if heads[0] == 12 else None)
    call.forced = False
    assert rope_attention_op._admit_triton(call) is None
    ref = _copy(call)
    out = rope_attention_op._run_triton(call)
    want = _unfused(ref)
    torch.cuda.synchronize()
    _check(call, ref, out, want, slots)


def test_fused_replays_in_a_graph_with_fresh_inputs():
    """Captured once, replayed with new qkv rows and the new keys' rows poisoned again: each
    replay writes them and agrees with the unfused pair."""
    call, slots = _case([576, 40], (32, 4, 128), torch.bfloat16, seed=3)
    rope_attention_op._run_triton(call)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rope_attention_op._run_triton(call)
    g = torch.Generator(device=DEV).manual_seed(9)
    for _ in range(2):
        call.rope.pool.k[slots] = float("nan")
        call.rope.pool.v[slots] = float("nan")
        call.rope.qkv.copy_(torch.randn(call.rope.qkv.shape, device=DEV, generator=g).bfloat16())
        ref = _copy(call)
        graph.replay()
        want = _unfused(ref)
        torch.cuda.synchronize()
        _check(call, ref, out, want, slots)
