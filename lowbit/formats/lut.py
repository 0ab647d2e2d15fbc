"""Learned-table formats `lut4` and `lut3`: a 16- or 8-entry float32 table per group of 256
rows, fitted by weighted k-means over the block-normalised weights; 64-weight blocks along
K with a bfloat16 absmax scale.

Shape legend: L leading dims, N rows, K columns, NB = ceil(K / 64), Kp = 64 * NB,
RG = ceil(N / 256) row groups per matrix, T = 2**bits table entries.
Payload: codes uint8 [L, N, Kp * bits / 8], scales bfloat16 [L, N, NB],
         table float32 [L, RG, T] (ascending), table_index int32 [L, N] (row -> its table
         within the same matrix; the encoder writes n // 256).
Encoding: s = bf16 block absmax (as nf4); x = fp32(w / s); code = nearest table entry,
ties to the even code.  Decoding: w = fp32(table[table_index[n], code] * s).
Table fit (not normative; any table decodes): per row group, a 2048-bin histogram over
x in [-1, 1] holding each bin's weight sum and weighted first moment (weight = s**2, times
an optional per-column importance; padding weighs 0), started from the NF4 / NF3 table,
then 16 Lloyd steps on the bins.  Cost: two passes over the weights, independent of the iteration count.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats.base import (
    PayloadSpec,
    check_input,
    map_rows,
    padded_blocks,
    row_chunks,
)
from lowbit.formats.codes import nearest_code, pack_codes, unpack_codes
from lowbit.formats.nf import NF3_TABLE, NF4_TABLE, NF_BLOCK, absmax_scales, normalise
from lowbit.formats.scalar import ScalarFormat, expand_blocks

ROWS_PER_TABLE = 256
BINS = 2048
LLOYD_STEPS = 16


def _weighted_histograms(
    w: Tensor, groups: int, rows_per_table: int, importance: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Per row group: bin weight sums and weighted first moments, float64 [G, BINS] each."""
    *lead, n, k = w.shape
    rg = -(-n // rows_per_table)
    rows = w.reshape(-1, k)
    wsum = torch.zeros(groups * BINS, dtype=torch.float64, device=w.device)
    msum = torch.zeros_like(wsum)
    imp = None
    if importance is not None:
        imp = torch.nn.functional.pad(importance.float(), (0, -(-k // NF_BLOCK) * NF_BLOCK - k))
    for r0, r1 in row_chunks(rows.shape[0], k):
        blocks = padded_blocks(rows[r0:r1], NF_BLOCK)  # [r, NB, B]
        sb = absmax_scales(blocks)  # [r, NB] bf16
        s = sb.float()
        x = normalise(blocks, sb).reshape(r1 - r0, -1)  # [r, Kp]
        wt = (s * s)[..., None].expand(blocks.shape).reshape(r1 - r0, -1)
        if imp is not None:
            wt = wt * imp
        if k % NF_BLOCK:
            wt = wt * (torch.arange(wt.shape[1], device=w.device) < k)  # padding has no weight
        r = torch.arange(r0, r1, device=w.device)
        gid = (r // n) * rg + (r % n) // rows_per_table  # [r]
        b = ((x.clamp(-1, 1) + 1) * (BINS / 2)).long().clamp(max=BINS - 1)
        flat = (gid[:, None] * BINS + b).reshape(-1)
        wt = wt.reshape(-1).double()
        wsum += torch.bincount(flat, wt, minlength=groups * BINS)
        msum += torch.bincount(flat, wt * x.reshape(-1).double(), minlength=groups * BINS)
    return wsum.reshape(groups, BINS), msum.reshape(groups, BINS)


def fit_tables(wsum: Tensor, msum: Tensor, init: Tensor) -> Tensor:
    """Weighted 1-D k-means on binned data: [G, BINS] sums -> float32 [G, T] ascending,
    starting from the ascending table init [T] (Lloyd steps never raise the binned error)."""
    g, size = wsum.shape[0], init.shape[0]
    centre = (torch.arange(BINS, dtype=torch.float64, device=wsum.device) + 0.5) * (2 / BINS) - 1
    mean = torch.where(wsum > 0, msum / wsum.clamp(min=1e-300), centre)  # [G, BINS]
    table = init.to(wsum.device, torch.float64).expand(g, size).contiguous()
    offs = torch.arange(g, device=wsum.device)[:, None] * size
    for _ in range(LLOYD_STEPS):
        table = table.sort(-1).values
        idx = nearest_code(mean, table) + offs  # [G, BINS]
        tw = torch.bincount(idx.reshape(-1), wsum.reshape(-1), minlength=g * size)
        tm = torch.bincount(idx.reshape(-1), msum.reshape(-1), minlength=g * size)
        table = torch.where(tw > 0, tm / tw.clamp(min=1e-300), table.reshape(-1)).reshape(g, size)
    return table.sort(-1).values.float()


class LutFormat(ScalarFormat):
    payload_names = ("codes", "scales", "table", "table_index")
    scale_dtype = torch.bfloat16
    scale_kind = "bf16"

    def __init__(self, name: str, bits: int, rows_per_table: int = ROWS_PER_TABLE):
        super().__init__(name, bits, NF_BLOCK)
        self.rows_per_table = rows_per_table
        self.init_table = torch.tensor(NF4_TABLE if bits == 4 else NF3_TABLE)

    def extra_spec(self, lead: tuple[int, ...], n: int, k: int) -> PayloadSpec:
        rg = -(-n // self.rows_per_table)
        return {
            "table": ((*lead, rg, 1 << self.bits), torch.float32),
            "table_index": ((*lead, n), torch.int32),
        }

    def encode(
        self, w: Tensor, importance: Tensor | None = None, table: Tensor | None = None
    ) -> dict[str, Tensor]:
        """importance: optional float [K] per-column weight for the fit (e.g. E[x**2]);
        table: optional float32 [L, RG, T] to use as is instead of fitting one."""
        check_input(self, w)
        *lead, n, k = w.shape
        rg = -(-n // self.rows_per_table)
        want = (*lead, rg, 1 << self.bits)
        if importance is not None and (
            tuple(importance.shape) != (k,) or not bool((importance >= 0).all())
        ):
            raise LowbitError(
                f"{self.name}: importance must be [{k}] non-negative finite values (one per "
                f"input column), got {list(importance.shape)}; pass e.g. the mean of x**2."
            )
        if table is None:
            groups = rg * (w.numel() // (n * k))
            wsum, msum = _weighted_histograms(w, groups, self.rows_per_table, importance)
            table = fit_tables(wsum, msum, self.init_table).reshape(want)
        elif tuple(table.shape) != want or table.dtype != torch.float32:
            raise LowbitError(
                f"{self.name}: a given table must be float32 {list(want)}, got "
                f"{table.dtype} {list(table.shape)}."
            )
        else:
            table = table.sort(-1).values
        index = (torch.arange(n, device=w.device) // self.rows_per_table).to(torch.int32)
        index = index.expand(*lead, n).contiguous()
        row_tables = table.reshape(-1, 1 << self.bits)[
            (torch.arange(w.numel() // k, device=w.device) // n) * rg + index.reshape(-1).long()
        ]  # [L * N, T]

        def rows(x: Tensor, r0: int, r1: int) -> dict[str, Tensor]:
            blocks = padded_blocks(x, NF_BLOCK)
            s = absmax_scales(blocks)
            xn = normalise(blocks, s).reshape(x.shape[0], -1)
            codes = nearest_code(xn, row_tables[r0:r1]).to(torch.uint8)
            return {"codes": pack_codes(codes, self.bits), "scales": s}

        return {**map_rows(w, rows), "table": table.contiguous(), "table_index": index}

    def block_fields(self, blocks: Tensor, payload: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"scales": absmax_scales(blocks)}

    def decode_padded(self, payload: dict[str, Tensor]) -> Tensor:
        codes = unpack_codes(payload["codes"], self.bits).long()  # [L, N, Kp]
        table = payload["table"]  # [L, RG, T]
        rows = torch.gather(
            table,
            -2,
            payload["table_index"].long()[..., None].expand(*codes.shape[:-1], table.shape[-1]),
        )  # [L, N, T]
        return expand_blocks(torch.gather(rows, -1, codes), payload["scales"].float())

    def view_table(self, payload: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        table = payload["table"]
        rg, size = table.shape[-2:]
        index = payload["table_index"]
        if table.dim() > 2:
            lead = index.shape[:-1]
            base = torch.arange(lead.numel(), dtype=torch.int32, device=index.device) * rg
            index = index + base.reshape(*lead, 1)
        flat = table.reshape(-1, size)
        return flat, (None if flat.shape[0] == 1 else index)
