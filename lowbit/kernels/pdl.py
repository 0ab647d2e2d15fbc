"""Programmatic dependent launch inside kernels: the device side of launch.pdl_args.

A kernel with a `PDL: tl.constexpr` parameter calls `pdl_enter(PDL)` after it has computed
its addresses and loaded what no earlier kernel writes (weights, gains), and before it reads
an activation or writes anything (the protocol in lowbit.kernels.launch). With PDL false it
compiles to nothing, so the interpreter and pre-sm_90 devices run the kernel unchanged.
"""

from __future__ import annotations

from lowbit.kernels.runtime import tl, triton


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the kernels before this one to complete (their writes visible), then let the
    next kernel in the stream launch."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)
