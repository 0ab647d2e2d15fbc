"""A probe of decode.e2m1_tile_bf16 shared by the CPU test and its GPU twin: every byte value
(both nibbles, both signs, the 0.5 code) under e4m3 scales from the smallest subnormal to
448, decoded in tiles with masked rows and a ragged K tail, against torch."""

from __future__ import annotations

import torch

from lowbit.formats.codes import e2m1_table
from lowbit.kernels.decode import e2m1_tile_bf16
from lowbit.kernels.runtime import interpreting, tl, triton


@triton.jit
def _probe_kernel(codes_ptr, scales_ptr, out_ptr, N, KC, stride_cn, stride_sn, stride_on,
                  BN: tl.constexpr, BK: tl.constexpr, B: tl.constexpr, ASM: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    for k0 in range(0, KC, BK):
        w = e2m1_tile_bf16(codes_ptr, scales_ptr, rows.to(tl.int64) * stride_cn,
                           rows.to(tl.int64) * stride_sn, rmask, k0, KC, BN, BK, B, 3, ASM)
        kk = k0 + tl.arange(0, BK)
        tl.store(out_ptr + rows[:, None] * stride_on + kk[None, :], w,
                 mask=rmask[:, None] & (kk < KC)[None, :])


def probe(device: str, n: int = 37, kc: int = 176, bk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel tiles, torch values) as bf16 [n, kc]: e2m1(code) * scale * 2**-8."""
    g = torch.Generator().manual_seed(n * kc)
    codes = torch.randint(0, 256, (n, kc // 2), generator=g, dtype=torch.uint8)
    codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every byte at least once
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 2**-9 .. 448
    nb = kc // 16
    scales = e4m3[torch.randint(0, e4m3.numel(), (n, nb), generator=g)].clone()
    scales.view(torch.uint8)[:, ::3] |= 0x80  # negative scales too
    c = codes.to(torch.int64)
    nib = torch.stack([c & 15, c >> 4], -1).reshape(n, kc)
    want = e2m1_table()[nib] * scales.float().repeat_interleave(16, 1) * 2.0**-8
    codes_d, scales_d = codes.to(device), scales.to(device)
    out = torch.full((n, kc), float("nan"), dtype=torch.bfloat16, device=device)
    bn = 16
    _probe_kernel[(triton.cdiv(n, bn),)](codes_d, scales_d, out, n, kc, codes.stride(0),
                                         scales.stride(0), out.stride(0), BN=bn, BK=bk, B=16,
                                         ASM=not interpreting())
    return out.cpu(), want.to(torch.bfloat16)
