"""Expert copies of an offloaded MoE layer: rows of host stacks into device slots, for a
device list of (expert, slot) pairs. No host read on CUDA, so a captured decode step copies
its own misses.

Shape legend: E experts, S slots, M pairs, W words of one expert's row of one tensor.
  src    [E, ...] host memory, pinned: the GPU reads it over PCIe through unified virtual
                  addressing (zero-copy), so no cudaMemcpy and no host-side decision is needed
  dst    [P, ...] device slots (P >= S)
  pairs  [M, 2] int64 (expert, slot); a row whose expert is < 0 copies nothing
Each program copies BLOCK words of one pair's row; rows are viewed as int32 words when their
byte size allows (16-byte vector loads on aligned rows), else as bytes. The tensors of a
call (a layer's w13 / w2 codes and scales, ...) go in one launch of _copy_pieces_kernel,
up to MAX_PIECES of them, grid (pairs, pieces, blocks of the longest row): a decode graph
gets one node a layer where it had one a tensor, and most programs find no miss and exit at
once. Invariant: the slot rows of one call are distinct (an
admission never gives two experts one slot).
"""

from __future__ import annotations

import torch

from lowbit.kernels.runtime import tl, triton

BLOCK = 4096  # words a program copies: 16 KiB of int32


MAX_PIECES = 6  # tensors one launch of _copy_pieces_kernel copies


@triton.jit
def _copy_piece(src_ptr, dst_ptr, W, e, s, blk, BLOCK: tl.constexpr):
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < W
    v = tl.load(src_ptr + e * W + offs, mask=m, cache_modifier=".cg")
    tl.store(dst_ptr + s * W + offs, v, mask=m)


@triton.jit
def _copy_pieces_kernel(pairs_ptr, s0, d0, w0, s1, d1, w1, s2, d2, w2, s3, d3, w3, s4, d4, w4,
                        s5, d5, w5, NP: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, k, blk): block blk (BLOCK elements: words or bytes) of pair i's row of
    tensor k (k < NP; the unused pointer arguments repeat tensor 0 and are never read)."""
    i = tl.program_id(0)
    k = tl.program_id(1)
    blk = tl.program_id(2)
    e = tl.load(pairs_ptr + 2 * i)
    if e >= 0:
        s = tl.load(pairs_ptr + 2 * i + 1)
        if k == 0:
            _copy_piece(s0, d0, w0, e, s, blk, BLOCK)
        if NP > 1:
            if k == 1:
                _copy_piece(s1, d1, w1, e, s, blk, BLOCK)
        if NP > 2:
            if k == 2:
                _copy_piece(s2, d2, w2, e, s, blk, BLOCK)
        if NP > 3:
            if k == 3:
                _copy_piece(s3, d3, w3, e, s, blk, BLOCK)
        if NP > 4:
            if k == 4:
                _copy_piece(s4, d4, w4, e, s, blk, BLOCK)
        if NP > 5:
            if k == 5:
                _copy_piece(s5, d5, w5, e, s, blk, BLOCK)


def _words(t: torch.Tensor) -> torch.Tensor:
    """t [R, ...] contiguous as [R, W] int32 words (or uint8 when a row is not 4-byte sized)."""
    flat = t.reshape(t.shape[0], -1).view(torch.uint8)
    return flat.view(torch.int32) if flat.shape[1] % 4 == 0 else flat


_REFUSALS: dict[str, str | None] = {}


def zero_copy_refusal(device: torch.device) -> str | None:
    """None when the kernel reads pinned host memory on `device` (checked once, with a small
    copy), else why not. Without it a CUDA step cannot copy its own misses."""
    if device.type != "cuda":
        return None
    key = str(device)
    if key not in _REFUSALS:
        src = torch.arange(3 * 1030, dtype=torch.int32).view(3, 1030).pin_memory()
        dst = torch.zeros(2, 1030, dtype=torch.int32, device=device)
        try:
            _copy_pieces(torch.tensor([[2, 1]], device=device), [(src, dst)], block=2048)
            ok = torch.equal(dst[1].cpu(), src[2]) and not dst[0].any().item()
            _REFUSALS[key] = None if ok else "the zero-copy probe read wrong values"
        except Exception as e:  # the driver or Triton refusing a host pointer
            _REFUSALS[key] = f"Triton cannot read pinned host memory here ({type(e).__name__}: {e})"
    return _REFUSALS[key]


def device_copies(dst: torch.Tensor) -> bool:
    """Whether copies into `dst` run as the Triton kernel (CUDA with zero-copy reads); else
    the host reads the pairs and torch copies (the CPU, where the device is host memory)."""
    return dst.is_cuda and zero_copy_refusal(dst.device) is None


def copy_experts(pairs: torch.Tensor, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor],
                 kernel: bool | None = None) -> None:
    """dst[k][slot] = src[k][expert] for every valid row of pairs [M, 2], every tensor k.
    kernel: force the Triton kernel (True; on CPU tensors in the interpreter) or torch."""
    if kernel is None:
        kernel = device_copies(next(iter(dst.values())))
    if not kernel:  # the host reads the pairs (eager steps)
        rows = [(e, s) for e, s in pairs.tolist() if e >= 0]
        if rows:
            e, s = torch.tensor(rows).T
            for k, d in dst.items():
                d[s.to(d.device)] = src[k][e].to(d.device)
        return
    pieces = [(_words(src[k]), _words(d)) for k, d in dst.items()]
    for i in range(0, len(pieces), MAX_PIECES):
        _copy_pieces(pairs, pieces[i:i + MAX_PIECES])


def _copy_pieces(pairs: torch.Tensor, group: list[tuple[torch.Tensor, torch.Tensor]],
                 block: int = BLOCK) -> None:
    """One launch of _copy_pieces_kernel over up to MAX_PIECES (src [E, W], dst [P, W]) pairs."""
    args = [x for a, b in group for x in (a, b, a.shape[1])]
    args += args[:3] * (MAX_PIECES - len(group))
    grid = (pairs.shape[0], len(group), triton.cdiv(max(a.shape[1] for a, _ in group), block))
    _copy_pieces_kernel[grid](pairs, *args, NP=len(group), BLOCK=block)
