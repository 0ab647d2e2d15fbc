"""Offline check of the programmatic-dependent-launch protocol (lowbit.kernels.launch) on
any machine: records the launches of one Qwen3-MoE-shaped decode layer's Triton kernels on
CPU tensors, compiles each for sm_90 with PDL on, and prints one JSON line per kernel: the
number of `griddepcontrol.wait`, and the global loads, stores and atomics the PTX has
before the first wait. The protocol allows loads of weights there and nothing else.

  python scripts/check_pdl.py
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def record() -> list:
    from lowbit.kernels import attention, launch, moe_slots, norm_op, rope_op, router_op

    T, D, H, Hkv, Dh, E, A = 2, 2048, 32, 4, 128, 128, 8
    x = torch.randn(T, D).bfloat16()
    with launch.recording() as launches:
        norm_op._run_triton(norm_op.NormCall(x, torch.ones(D).bfloat16(), 1e-6, x.clone()))
        qkv = torch.randn(T, (H + 2 * Hkv) * Dh).bfloat16()
        pool = attention.KVPool(torch.zeros(64, Hkv, Dh).bfloat16(), torch.zeros(64, Hkv, Dh).bfloat16(), 16)
        rope_op._run_triton(rope_op.RopeCall(
            qkv, H, Hkv, Dh, torch.zeros(T, dtype=torch.long), torch.zeros(64, Dh),
            torch.ones(Dh).bfloat16(), torch.ones(Dh).bfloat16(), 1e-6, pool,
            torch.zeros(T, dtype=torch.long)))
        attention.paged_decode(torch.randn(T, H, Dh).bfloat16(), pool,
                               torch.zeros(T, 4, dtype=torch.int32),
                               torch.full((T,), 40, dtype=torch.int32), 0.1, num_splits=2)
        attention.paged_decode(  # the rope_attention op's kernel: q and the new key made in it
            qkv[:, : H * Dh].unflatten(1, (H, Dh)), pool, torch.zeros(T, 4, dtype=torch.int32),
            torch.full((T,), 40, dtype=torch.int32), 0.1, num_splits=2, config=dict(FOLD=True),
            rope=attention.DecodeRope(torch.zeros(T, dtype=torch.long), torch.zeros(64, Dh),
                                      torch.ones(Dh).bfloat16(), torch.ones(Dh).bfloat16(), 1e-6,
                                      torch.zeros(T, dtype=torch.long)))
        call = router_op.RouterCall(None, router_op.RouterSpec(top_k=A), None, x=x,
                                    gate_w=torch.randn(E, D), gate_b=None)
        router_op._run_triton(call)
        ids = torch.randint(0, E, (T * A,), dtype=torch.int32)
        moe_slots.sort_by_expert(ids, E, 8)  # one launch (few blocks)
        moe_slots.sort_by_expert(torch.randint(0, E, (2048,), dtype=torch.int32), E, 8)  # the pair
        norm_op._run_triton(norm_op.NormCall(x, torch.ones(D).bfloat16(), 1e-6, x.clone(),
                                             slots=moe_slots.SlotSum(torch.randn(T * A, D), ids, A, E, x.clone())))
        moe_slots.sort_for_fold(ids, E, 8, A, x.clone())
        moe_slots.combine_slots(torch.randn(T * A, D), x, A, ids, E)
    return launches


def check(kernel, args, kwargs) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from tune_kernels import _signature

    kwargs = {k: v for k, v in kwargs.items() if k != "launch_pdl"}
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    kwargs["PDL"] = True
    sig, consts, attrs = _signature(kernel, args, kwargs)
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(options, launch_pdl=True))
    ptx = compiled.asm["ptx"]
    head = ptx.split("griddepcontrol.wait")[0]
    return {"kernel": kernel.fn.__name__, "waits": ptx.count("griddepcontrol.wait"),
            "launch_dependents": ptx.count("griddepcontrol.launch_dependents"),
            "loads_before": len(re.findall(r"ld\.global", head)),
            "stores_before": len(re.findall(r"st\.global", head)),
            "atomics_before": len(re.findall(r"atom\.", head)),
            "launch_pdl": bool(compiled.metadata.launch_pdl)}


def main() -> None:
    for kernel, _grid, args, kwargs in record():
        print(json.dumps(check(kernel, args, dict(kwargs))))


if __name__ == "__main__":
    main()
