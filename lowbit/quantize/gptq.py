"""Calibrated rounding for the scalar formats: GPTQ-style error feedback with a Linear's
input Hessian, written as the format's own canonical payload.

Shape legend: L leading dims (stacked experts), N rows, K input columns, B the format's
block along K, T = 2**bits table entries, C columns per lazy-update chunk.

For one matrix W [N, K] and H = X^T X over calibration inputs X [tokens, K], rounding
minimises ||X W^T - X Q^T||^2 column by column: H is damped (H += damp * mean(diag H) * I;
columns never seen (diag 0) are zeroed and get H = 1), U is the upper Cholesky factor of
H^-1, and columns are taken in order. When column k opens a block, that block's fields
(scale, int4's zero point) are what the format's encoder picks for the block's weights as
updated so far; every column of the block is then rounded to the nearest value of the
format's grid under that scale, table[code] * scale + offset (the LUT view), and the error
e = (w_k - q_k) / U[k, k] is fed to the later columns: W[:, j] -= e * U[k, j].
Matrix-level fields (nvfp4's global scale, lut tables) are those of round-to-nearest.
The result is a payload the format's check and decode accept unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats import QuantizedTensor
from lowbit.formats.base import decode_scales
from lowbit.formats.codes import pack_codes
from lowbit.formats.scalar import ScalarFormat

DAMP = 0.01  # fraction of the mean Hessian diagonal added to the diagonal
CHUNK = 128  # columns per lazy batch of error updates (a multiple of every block size)


def inverse_factor(h: Tensor, damp: float) -> tuple[Tensor, Tensor]:
    """h float [L, K, K] -> (upper Cholesky factor of (h + damping)^-1, float32 [L, K, K];
    dead columns bool [L, K])."""
    h = h.to(torch.float64, copy=True)
    diag = torch.diagonal(h, dim1=-2, dim2=-1)  # a view: the edits below land in h
    dead = diag <= 0
    diag[dead] = 1.0
    diag += damp * diag.mean(-1, keepdim=True)
    chol, info = torch.linalg.cholesky_ex(h)
    if bool(info.any()):
        raise LowbitError("a calibration Hessian is not positive definite even after damping; "
                          "raise the damping or give more calibration text.")
    hinv = torch.cholesky_inverse(chol)
    return torch.linalg.cholesky(hinv, upper=True).float(), dead


def row_tables(fmt: ScalarFormat, payload: dict[str, Tensor], lead: int, n: int) -> Tensor:
    """Each row's grid before scaling, float32 [L, N, T] (from the format's LUT view)."""
    view = fmt.lut_view(payload)
    assert view.global_scale == 1.0, "scalar formats fold global scales into their tables"
    if view.table_index is None:
        return view.table[0].expand(lead, n, -1)
    return view.table[view.table_index.long().reshape(lead, n)]


def gptq_quantize(fmt: ScalarFormat, w: Tensor, h: Tensor, damp: float = DAMP) -> QuantizedTensor:
    """w [N, K] or [L, N, K] float; h [K, K] or [L, K, K] (one Hessian per matrix)."""
    if not isinstance(fmt, ScalarFormat):
        raise LowbitError(f"calibrated rounding covers the scalar formats; {fmt.name} is not one.")
    shape = tuple(w.shape)
    w3 = w.reshape(-1, *shape[-2:]).float()
    h3 = h.reshape(-1, shape[-1], shape[-1]).float()
    lead, n, k = w3.shape
    bsz = fmt.block_size
    kp = fmt.padded_k(k)
    base = fmt.encode(w3)  # round-to-nearest: the matrix-level fields come from here
    u, dead = inverse_factor(h3, damp)  # [L, K, K], [L, K]
    work = w3.masked_fill(dead[:, None, :], 0.0)  # [L, N, K]
    tables = row_tables(fmt, base, lead, n).to(w3.device)  # [L, N, T]
    codes = torch.zeros(lead, n, kp, dtype=torch.uint8, device=w3.device)
    fields: dict[str, list[Tensor]] = {}
    grid = tables
    for c0 in range(0, k, CHUNK):
        c1 = min(k, c0 + CHUNK)
        err = torch.empty(lead, n, c1 - c0, device=w3.device)
        for j in range(c0, c1):
            if j % bsz == 0:
                grid = _open_block(fmt, base, work[..., j:min(k, j + bsz)], tables, fields, bsz)
            x = work[..., j]  # [L, N]
            code = (x[..., None] - grid).abs().argmin(-1)  # [L, N]
            q = grid.gather(-1, code[..., None])[..., 0]
            codes[..., j] = code.to(torch.uint8)
            e = (x - q) / u[:, j, j, None]  # [L, N]
            work[..., j + 1:c1] -= e[..., None] * u[:, None, j, j + 1:c1]
            err[..., j - c0] = e
        work[..., c1:] -= err @ u[:, c0:c1, c1:]  # [L, N, C] @ [L, C, K - c1]
    if kp > k:  # padding columns hold the code of 0.0 under the last block's scale
        codes[..., k:] = grid.abs().argmin(-1, keepdim=True).to(torch.uint8)
    payload = dict(base)
    payload.update({key: torch.stack(v, -1) for key, v in fields.items()})
    payload["codes"] = pack_codes(codes.reshape(lead * n, kp), fmt.bits).reshape(lead, n, -1)
    if len(shape) == 2:
        payload = {key: v[0] for key, v in payload.items()}
    return QuantizedTensor(fmt, shape, payload)


def _open_block(fmt: ScalarFormat, base: dict[str, Tensor], cols: Tensor, tables: Tensor,
                fields: dict[str, list[Tensor]], bsz: int) -> Tensor:
    """Fix the block's fields from its current weights cols [L, N, <=B]; return its grid
    [L, N, T] in the order the LUT kernels evaluate it: table * scale + offset."""
    if cols.shape[-1] < bsz:
        cols = torch.nn.functional.pad(cols, (0, bsz - cols.shape[-1]))
    picked = fmt.block_fields(cols, base)
    for key, v in picked.items():
        fields.setdefault(key, []).append(v)
    grid = tables * decode_scales(picked["scales"], fmt.scale_kind)[..., None]
    offsets = fmt.view_offsets(picked)
    return grid if offsets is None else grid + offsets.float()[..., None]
