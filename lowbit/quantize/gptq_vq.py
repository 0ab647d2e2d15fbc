"""Calibrated rounding for the vector codebook formats: GPTQ error feedback over groups of
D columns, each group's entries chosen in the metric of the rounding loss.

Shape legend: L leading dims (stacked experts), N rows, K input columns, Kp = K padded to
64, D weights per group, C codebook entries, CH columns per lazy-update chunk.

W [N, K] and H are padded to Kp (padding columns are dead: zero weight, unit Hessian).
U is the upper Cholesky factor of the damped H^-1 (lowbit.quantize.gptq.inverse_factor).
Groups go left to right. When a group opens a block of 64, the block's scale s is what the
format's encoder picks for the block's current weights (updated by the error of earlier
groups). Rounding the group's columns g jointly to q = s * c costs, once the later
columns absorb the error, e A (A^T e^T) with e = w_g - q and A = U[g, g]^-1: the entry c
minimises ||(w_g - s c) A||^2 (for D = 1 this is GPTQ's nearest value). Its error
E = (w_g - q) A updates the later columns, W[:, j] -= E U[g, j] (lazily, per chunk of 128).
The result is the format's own payload: decoding and kernels read it unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit.formats import QuantizedTensor
from lowbit.formats.base import Format
from lowbit.formats.scalar import ScalarFormat
from lowbit.formats.vq import VQ_BLOCK, VqFormat, pack_indices
from lowbit.quantize.gptq import CHUNK, DAMP, gptq_quantize, inverse_factor

# expert matrices rounded per call: bounds the float64 inverse-Hessian work, about
# 4 * 8 * K^2 bytes a matrix (2.1 GiB for 16 at K = 2,048; docs/BENCHMARKS.md "Calibrated rounding")
MATRICES_PER_CALL = 16


def calibrated_rounding(fmt: Format, w: Tensor, h: Tensor, damp: float = DAMP) -> QuantizedTensor:
    """GPTQ rounding of w [N, K] / [L, N, K] on h [K, K] / [L, K, K] in a scalar or vector
    format; a stack of more than MATRICES_PER_CALL matrices goes in slices of that many (each
    matrix is rounded alone, and its payload fields lead with L, so the slices concatenate)."""
    if w.dim() == 3 and w.shape[0] > MATRICES_PER_CALL:
        shared = h.dim() == 2 or h.shape[0] == 1
        parts = [calibrated_rounding(fmt, w[i:i + MATRICES_PER_CALL], h if shared else h[i:i + MATRICES_PER_CALL],
                                     damp) for i in range(0, w.shape[0], MATRICES_PER_CALL)]
        payload = {key: torch.cat([p.payload[key] for p in parts]) for key in parts[0].payload}
        return QuantizedTensor(fmt, tuple(w.shape), payload)
    if isinstance(fmt, VqFormat):
        return gptq_quantize_vq(fmt, w, h, damp)
    return gptq_quantize(fmt, w, h, damp)


def has_calibrated_rounding(fmt: Format) -> bool:
    return isinstance(fmt, (ScalarFormat, VqFormat))


def gptq_quantize_vq(fmt: VqFormat, w: Tensor, h: Tensor, damp: float = DAMP) -> QuantizedTensor:
    """w [N, K] or [L, N, K] float; h [K, K] or [L, K, K] (one Hessian per matrix)."""
    shape = tuple(w.shape)
    k = shape[-1]
    kp = -(-k // VQ_BLOCK) * VQ_BLOCK
    w3 = torch.nn.functional.pad(w.reshape(-1, *shape[-2:]).float(), (0, kp - k))  # [L, N, Kp]
    h3 = torch.nn.functional.pad(h.reshape(-1, k, k).float(), (0, kp - k, 0, kp - k))
    lead, n, _ = w3.shape
    h3 = h3.expand(lead, kp, kp) if h3.shape[0] == 1 else h3  # one Hessian for every matrix
    d = fmt.dim
    cb = fmt.codebook.to(w3.device, torch.float32)  # [C, D]
    u, dead = inverse_factor(h3, damp)  # [L, Kp, Kp], [L, Kp]
    work = w3.masked_fill(dead[:, None, :], 0.0)
    idx = torch.zeros(lead, n, kp // d, dtype=torch.long, device=w3.device)
    scales = []
    s = torch.zeros(lead, n, device=w3.device)
    for c0 in range(0, kp, CHUNK):
        c1 = min(kp, c0 + CHUNK)
        err = torch.empty(lead, n, c1 - c0, device=w3.device)
        for g0 in range(c0, c1, d):
            if g0 % VQ_BLOCK == 0:
                sb, _ = fmt.encode_blocks(work[..., g0:g0 + VQ_BLOCK], cb)  # [L, N] bf16
                scales.append(sb)
                s = sb.float()
            a = torch.linalg.inv(u[:, g0:g0 + d, g0:g0 + d])  # [L, D, D] upper triangular
            code, e = _pick(work[..., g0:g0 + d], s, cb, a)
            idx[..., g0 // d] = code
            work[..., g0 + d:c1] -= e @ u[:, g0:g0 + d, g0 + d:c1]
            err[..., g0 - c0:g0 - c0 + d] = e
        work[..., c1:] -= err @ u[:, c0:c1, c1:]
    payload = {"codes": pack_indices(idx, fmt.index_bits), "scales": torch.stack(scales, -1)}
    if len(shape) == 2:
        payload = {key: v[0] for key, v in payload.items()}
    return QuantizedTensor(fmt, shape, payload)


def _pick(x: Tensor, s: Tensor, cb: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """Entries for x [L, N, D] under scales s [L, N] in the metric A [L, D, D]:
    argmin_c ||(x - s c) A||^2; returns (indices [L, N], scaled errors (x - s c) A [L, N, D])."""
    ca = cb @ a  # [L, C, D]
    inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)[..., None]  # s = 0: q = 0
    norms = ca.pow(2).sum(-1)[:, None, :].expand(-1, x.shape[1], -1)  # [L, N, C]
    code = torch.baddbmm(norms, (x @ a) * inv, ca.transpose(1, 2), alpha=-2.0).argmin(-1)  # [L, N]
    q = cb[code] * s[..., None]  # [L, N, D]
    return code, (x - q) @ a
