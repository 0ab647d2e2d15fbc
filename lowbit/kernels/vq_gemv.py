"""Vector codebook GEMV: y[M, N] = x[M, K] @ W^T (+ bias) for M <= 16, W a `VqWeight`.

Shape legend: M activation rows (BM per program, 1 / 2 / 4), N output features (weight
rows, BN per program), K input features, Kp = K padded to 64, D weights per group,
IB index bits, C = 2**IB codebook entries, G = Kp / D groups per row (BG per K step).

Memory layout (lowbit.formats.vq, docs/FORMATS.md §3.8): codes uint8 [N, G * IB / 8],
row stride stride_cn bytes (IB = 8: one byte per group; IB = 12: groups 2j, 2j + 1 in the
24 bits of bytes 3j..3j+2, low group first); scales bfloat16 [N, Kp / 64] read as their
int16 bit pattern (bf16 -> fp32 is a 16-bit shift, exact); codebook float32 [C, D]
contiguous (4 KiB for 256 x 4, 64 KiB for 4096 x 4: it stays in L1 / L2, read by gather).

Float32-gather form (`_vq_gemv_kernel`: config PACKED False, and any codebook that is not
float16-valued): a program owns BN rows and BM activation rows and walks all of K in steps of BG
groups: it loads the [BN, BG] indices and scales once, then for each of the D lanes of a
group gathers codebook[idx, j] * scale and multiplies it with the x values at columns
D g + j ([BM, BG]), reducing over the groups into a float32 [BM, BN] accumulator.
Invariant: columns k >= K read x as 0 (padding never reaches y), rows n >= N and groups
g >= G are masked, so the kernel reads no byte outside the tensors.

Packed form (VqWeight.packed: the float16 entries of a codebook row as one int64; every
shipped codebook), `_vq_gemv_blocks_kernel`: a program owns BN rows and BM activation rows
and walks its split's share of the 64-weight scale blocks, BB blocks a step, with the
step's groups as [BN, BB, GPB] tensors (GPB = 64 / D groups a block): one int64 gather a
group, its lanes split by shifts and multiplied by x columns D g + j, held elementwise in a
float32 [BM, BN, BB, GPB] accumulator with one scale load a (row, block). The sum over
groups happens once, after the K loop: no cross-lane reduction in the loop, which is what
the first packed form (a [BM, BN, BG * D] product summed every step) spent most of its
instructions on (offline sm_90 compile, lane instructions a weight in the main loop at
BM = 1, BN 32, four warps: vq2 / vq3 / vq4 25.5 / 29.5 / 30.4 before, 5.2 / 6.6 / 6.6 now at
BB 4). Split-K (SPLIT_K programs along K, config SPLIT_K 0: about four programs per SM)
writes float32 partials to a workspace and the split that arrives last sums them in split
order (deterministic, lowbit.kernels.dequant_gemm's counters); the per-slot MoE kernels of
lowbit.kernels.vq_moe run the same K step without splits.
Reference twin: `reference_vq_linear` (decode with lowbit.formats.vq.vq_decode, float32
matmul).
"""

from __future__ import annotations

import torch

from lowbit.formats.views import VqWeight
from lowbit.kernels.dequant_gemm import _publish, _sum_splits
from lowbit.kernels.runtime import semaphore, sm_count, tl, triton

GEMV_MAX_M = 16  # rows a launch takes (BM = 4 per program, more programs along M)
DEFAULT_CONFIG = {"BN": 32, "BG": 32, "num_warps": 4}  # the float32-gather kernel
# the packed kernel: BB scale blocks (64 weights) a K step (0: 4 at BM = 1, else 2), SPLIT_K
# (0: about 4 programs an SM); offline sm_90 compile at BM = 1, BN 32, four warps: BB 4 runs
# 5.2 / 6.6 / 6.6 lane instructions a weight (vq2 / vq3 / vq4), BB 2 6.5 / 10.3 / 8.7
BLOCKS_CONFIG = {"BN": 32, "BB": 0, "SPLIT_K": 0, "num_warps": 4}


@triton.jit
def _vq_load(ptr, mask):
    """tl.load with masked entries 0; mask None: no mask (the EVEN case)."""
    if mask is None:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0)


@triton.jit
def _vq_idx12(pb, low, mask):
    """12-bit indices of groups whose pair starts at byte pointers pb: the low 12 bits of the
    pair's 24 (low: the pair's first group) or the high 12; masked entries read 0."""
    v = _vq_load(pb, mask).to(tl.int32)
    v = v | (_vq_load(pb + 1, mask).to(tl.int32) << 8)
    v = v | (_vq_load(pb + 2, mask).to(tl.int32) << 16)
    return tl.where(low, v & 0xFFF, v >> 12)


@triton.jit
def _vq_groups(row_codes, row_scales, gi, m2, D: tl.constexpr, IB: tl.constexpr):
    """Indices int32 [BN, BG] and float32 scales [BN, BG] of groups gi of the rows whose code
    and scale rows start at row_codes / row_scales [BN, 1] (pointers)."""
    if IB == 12:
        idx = _vq_idx12(row_codes + 3 * (gi // 2)[None, :], (gi % 2 == 0)[None, :], m2)
    else:
        idx = tl.load(row_codes + gi[None, :], mask=m2, other=0).to(tl.int32)
    sbits = tl.load(row_scales + (gi * D // 64)[None, :], mask=m2, other=0).to(tl.int32) & 0xFFFF
    return idx, (sbits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _vq_half(v, SHIFT: tl.constexpr):
    """The float16 in bits SHIFT..SHIFT + 15 of int32 v, as float32 (exact)."""
    return ((v >> SHIFT) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _vq_block_idx(crow, gi, mask, IB: tl.constexpr):
    """Indices int32 [BN, BB, GPB] of groups gi [BB, GPB] of the rows whose code rows start
    at crow [BN, 1, 1] (pointers); masked entries read index 0."""
    if IB == 12:
        return _vq_idx12(crow + 3 * (gi // 2)[None, :, :], (gi % 2 == 0)[None, :, :], mask)
    else:
        return _vq_load(crow + gi[None, :, :], mask).to(tl.int32)


@triton.jit
def _vq_block_dot(cbp_ptr, idx, mask, xg, BM: tl.constexpr, BB: tl.constexpr, GPB: tl.constexpr,
                  D: tl.constexpr):
    """Unscaled group dots float32 [BM, BN, BB, GPB]: sum_j codebook[idx, j] * xg[.., j] with
    idx [BN, BB, GPB] read from the packed codebook (one int64 gather a group, lane j in
    bits 16 j..) and xg float32 [BM, BB, GPB, D] the groups' activation columns."""
    word = _vq_load(cbp_ptr + idx, mask)
    lo = word.to(tl.int32)  # lanes 0, 1
    if D == 2:
        x0, x1 = tl.split(xg)
        return _vq_half(lo, 0)[None] * x0[:, None] + _vq_half(lo, 16)[None] * x1[:, None]
    else:
        hi = (word >> 32).to(tl.int32)  # lanes 2, 3
        even, odd = tl.split(tl.reshape(xg, [BM, BB, GPB, 2, 2]))  # lanes (0, 2) and (1, 3)
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        return (_vq_half(lo, 0)[None] * x0[:, None] + _vq_half(lo, 16)[None] * x1[:, None]
                + _vq_half(hi, 0)[None] * x2[:, None] + _vq_half(hi, 16)[None] * x3[:, None])


@triton.jit
def _vq_block_step(xrow, mmask, crow, srow, rmask, cbp_ptr, b0, kb1, K, D: tl.constexpr, IB: tl.constexpr,
                   BM: tl.constexpr, BB: tl.constexpr, EVEN: tl.constexpr):
    """One K step of the packed schedule: float32 [BM, BN, BB, GPB], the scaled group dots of
    blocks b0 .. b0 + BB (those below kb1) of the rows whose code / scale rows start at crow
    [BN, 1, 1] / srow [BN, 1] (rows outside rmask [BN] masked) with the activation rows at
    xrow ([BM, 1, 1, 1] pointers, or one pointer; rows outside mmask [BM] read 0, columns
    from K on too). EVEN: nothing to mask."""
    GPB: tl.constexpr = 64 // D
    bi = b0 + tl.arange(0, BB)  # [BB]
    gi = bi[:, None] * GPB + tl.arange(0, GPB)[None, :]  # [BB, GPB]
    col = gi[:, :, None] * D + tl.arange(0, D)[None, None, :]  # [BB, GPB, D]
    if EVEN:
        idx = _vq_block_idx(crow, gi, None, IB)
        sbits = tl.load(srow + bi[None, :])
        xg = tl.load(xrow + col[None]).to(tl.float32)
        part = _vq_block_dot(cbp_ptr, idx, None, xg, BM, BB, GPB, D)
    else:
        bmask = bi < kb1
        m3 = rmask[:, None, None] & bmask[None, :, None]  # [BN, BB, 1]
        idx = _vq_block_idx(crow, gi, m3, IB)
        sbits = tl.load(srow + bi[None, :], mask=rmask[:, None] & bmask[None, :], other=0)
        xm = mmask[:, None, None, None] & (bmask[:, None, None] & (col < K))[None]
        xg = tl.load(xrow + col[None], mask=xm, other=0.0).to(tl.float32)  # [BM, BB, GPB, D]
        part = _vq_block_dot(cbp_ptr, idx, m3, xg, BM, BB, GPB, D)
    sc = ((sbits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)  # [BN, BB]
    return part * sc[None, :, :, None]


@triton.jit
def _vq_gemv_blocks_kernel(
    x_ptr, y_ptr, bias_ptr, ws_ptr, sem_ptr, codes_ptr, scales_ptr, cbp_ptr,
    M, N, K, NB, bps, SPLIT_K, stride_xm, stride_ym, stride_cn, stride_sn,
    D: tl.constexpr, IB: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BB: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr,
):
    """The packed form (module docstring). Grid (N / BN, SPLIT_K, M / BM); split p walks
    blocks p * bps .. min((p + 1) * bps, NB), bps a multiple of BB. EVEN: N % BN, M % BM,
    NB % BB are 0 and K = 64 NB, so no load needs a mask."""
    GPB: tl.constexpr = 64 // D
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_n * BN + tl.arange(0, BN)  # [BN]
    rmask = rows < N
    ms = pid_m * BM + tl.arange(0, BM)  # [BM]
    mmask = ms < M
    crow = codes_ptr + rows[:, None, None].to(tl.int64) * stride_cn  # [BN, 1, 1]
    srow = scales_ptr + rows[:, None].to(tl.int64) * stride_sn  # [BN, 1]
    xrow = x_ptr + ms[:, None, None, None].to(tl.int64) * stride_xm  # [BM, 1, 1, 1]
    kb0 = pid_k * bps
    kb1 = tl.minimum(kb0 + bps, NB)
    acc = tl.zeros([BM, BN, BB, GPB], dtype=tl.float32)
    for b0 in range(kb0, kb1, BB):
        acc += _vq_block_step(xrow, mmask, crow, srow, rmask, cbp_ptr, b0, kb1, K, D, IB, BM, BB, EVEN)
    y = tl.sum(tl.sum(acc, 3), 2)  # [BM, BN]
    ymask = mmask[:, None] & rmask[None, :]
    yoff = ms[:, None] * stride_ym + rows[None, :]
    if SPLIT:
        part_off = ms[:, None] * N + rows[None, :]
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = _publish(ws_ptr, part_off, y, ymask, pid_k, M * N, sem_ptr, tile)
        if arrived == SPLIT_K - 1:  # the last split sums all of them in split order
            tot = _sum_splits(ws_ptr, part_off, ymask, M * N, SPLIT_K, tl.zeros([BM, BN], tl.float32))
            if HAS_BIAS:
                tot += tl.load(bias_ptr + rows, mask=rmask, other=0).to(tl.float32)[None, :]
            tl.store(y_ptr + yoff, tot.to(y_ptr.dtype.element_ty), mask=ymask)
            tl.atomic_xchg(sem_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=rmask, other=0).to(tl.float32)[None, :]
        tl.store(y_ptr + yoff, y.to(y_ptr.dtype.element_ty), mask=ymask)


@triton.jit
def _vq_gemv_kernel(
    x_ptr, y_ptr, bias_ptr, codes_ptr, scales_ptr, cb_ptr,
    M, N, K, G, stride_xm, stride_ym, stride_cn, stride_sn,
    D: tl.constexpr, IB: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr,
):
    """The float32-gather form: cb_ptr is the float32 codebook [C, D], D gathers a group."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)  # [BN]
    rmask = rows < N
    ms = pid_m * BM + tl.arange(0, BM)  # [BM]
    mmask = ms < M
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for g0 in range(0, G, BG):
        gi = g0 + tl.arange(0, BG)  # [BG]
        m2 = rmask[:, None] & (gi < G)[None, :]  # [BN, BG]
        idx, s = _vq_groups(codes_ptr + rows[:, None].to(tl.int64) * stride_cn,
                            scales_ptr + rows[:, None].to(tl.int64) * stride_sn, gi, m2, D, IB)  # [BN, BG]
        for j in tl.static_range(D):
            wv = tl.load(cb_ptr + idx * D + j, mask=m2, other=0.0) * s  # [BN, BG]
            col = gi * D + j  # [BG]
            xm = mmask[:, None] & (col < K)[None, :]
            xv = tl.load(x_ptr + ms[:, None] * stride_xm + col[None, :], mask=xm,
                         other=0.0).to(tl.float32)  # [BM, BG]
            acc += tl.sum(wv[None, :, :] * xv[:, None, :], axis=2)  # [BM, BN]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rmask, other=0).to(tl.float32)[None, :]
    yp = y_ptr + ms[:, None] * stride_ym + rows[None, :]
    tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & rmask[None, :])


def vq_gemv_refusal(x: torch.Tensor, w: VqWeight, bias: torch.Tensor | None = None) -> str | None:
    """Why vq_gemv cannot take this call, or None."""
    if w.lead != ():
        return "weight is stacked; the gemv takes [N, K]"
    if x.dim() != 2 or x.shape[0] > GEMV_MAX_M:
        return f"the vq gemv takes x [M <= {GEMV_MAX_M}, K], got {list(x.shape)}"
    if x.shape[1] > w.kp:
        return f"x has {x.shape[1]} columns but the weight stores {w.kp}"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations are {x.dtype}"
    if w.index_bits not in (8, 12):
        return f"{w.index_bits}-bit indices have no kernel"
    if w.codes.stride(-1) != 1 or w.scales.stride(-1) != 1 or not w.codebook.is_contiguous():
        return "codes, scales and codebook rows must be contiguous"
    if w.codebook.dtype != torch.float32 or w.scales.dtype != torch.bfloat16:
        return f"codebook {w.codebook.dtype} / scales {w.scales.dtype}: expected float32 / bfloat16"
    if bias is not None and (tuple(bias.shape) != (w.n,) or not bias.is_floating_point()):
        return f"bias is {bias.dtype} {list(bias.shape)}, expected a float [{w.n}]"
    devices = {t.device for t in (x, w.codes, w.scales, w.codebook)}
    if len(devices) != 1:
        return f"tensors on several devices: {sorted(str(d) for d in devices)}"
    return None


def vq_gemv(x: torch.Tensor, w: VqWeight, bias: torch.Tensor | None = None,
            config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] in x.dtype (schedule and layout: module docstring); into out [M, N] (row
    stride free, last dim contiguous) when given."""
    reason = vq_gemv_refusal(x, w, bias)
    if reason is not None:
        raise ValueError(f"vq_gemv: {reason}")
    m, k = x.shape
    n = w.n
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (m, n) and y.dtype == x.dtype and y.stride(-1) == 1, "out must be [M, N] in x.dtype"
    bm = 1 if m == 1 else (2 if m == 2 else 4)
    if w.packed is not None and (config or {}).get("PACKED", True):
        return _blocks(x, w, bias, y, bm, {**BLOCKS_CONFIG, **(config or {})})
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    groups = w.kp // w.dim
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, bm))
    _vq_gemv_kernel[grid](
        x, y, x if bias is None else bias.contiguous(), w.codes, w.scales.view(torch.int16),
        w.codebook, m, n, k, groups, x.stride(0), y.stride(0), w.codes.stride(-2),
        w.scales.stride(-2), D=w.dim, IB=w.index_bits, HAS_BIAS=bias is not None, BM=bm,
        BN=cfg["BN"], BG=cfg["BG"], num_warps=cfg["num_warps"],
    )
    return y


def blocks_split_plan(cfg: dict, nb: int, tiles: int) -> tuple[int, int]:
    """(splits, blocks per split, a multiple of BB) along K for the packed kernel. SPLIT_K 0
    in a config: about four programs per SM, at most 8, at most one split per BB blocks."""
    bb = cfg["BB"]
    split = cfg.get("SPLIT_K", 0) or min(8, max(1, round(4 * sm_count() / max(tiles, 1))))
    split = max(1, min(split, triton.cdiv(nb, bb)))
    bps = triton.cdiv(triton.cdiv(nb, split), bb) * bb
    return triton.cdiv(nb, bps), bps


def _blocks(x: torch.Tensor, w: VqWeight, bias: torch.Tensor | None, y: torch.Tensor, bm: int,
            cfg: dict) -> torch.Tensor:
    """The packed kernel's launch (module docstring)."""
    m, k = x.shape
    n, nb, bn = w.n, w.kp // 64, cfg["BN"]
    bb = cfg["BB"] or (4 if bm == 1 else 2)
    cfg = {**cfg, "BB": bb}
    grid_n, grid_m = triton.cdiv(n, bn), triton.cdiv(m, bm)
    split, bps = blocks_split_plan(cfg, nb, grid_n * grid_m)
    ws = torch.empty(split if split > 1 else 1, m, n, dtype=torch.float32, device=x.device)
    sem = semaphore(x.device, grid_n * grid_m)
    even = n % bn == 0 and m % bm == 0 and nb % bb == 0 and k == 64 * nb
    _vq_gemv_blocks_kernel[(grid_n, split, grid_m)](
        x, y, x if bias is None else bias.contiguous(), ws, sem, w.codes, w.scales.view(torch.int16),
        w.packed, m, n, k, nb, bps, split, x.stride(0), y.stride(0), w.codes.stride(-2),
        w.scales.stride(-2), D=w.dim, IB=w.index_bits, HAS_BIAS=bias is not None, BM=bm, BN=bn,
        BB=bb, EVEN=even, SPLIT=split > 1, num_warps=cfg["num_warps"],
    )
    return y


def reference_vq_linear(x: torch.Tensor, w: VqWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin: decode with the format's reference, matmul in float32, cast to x.dtype."""
    y = x.float() @ w.dense(x.shape[-1]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
