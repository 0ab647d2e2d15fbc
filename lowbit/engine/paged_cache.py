"""Paged KV cache: the pool of blocks that the block manager hands out.

Layout per layer: k [num_blocks + 1, block_size, Hkv, Dk], v [..., Dv], allocated at the
layer's first write, when its head shapes are known. MLA layers (DeepSeek) store their
compressed latent through the same contract as one head: k = c_kv [.., 1, kv_lora_rank],
v = k_pe [.., 1, qk_rope_head_dim] (lowbit.layers.attention.latent_attention).
The extra last block is scratch: padded rows of a fixed-shape step write there. Token position p of a sequence lives at row
`block_table[p // block_size] * block_size + p % block_size` of the flattened pool.

`layer_pool(layer, k, v)` hands a layer's flat storage to the attention kernels, which
write through the batch's slot mapping and read through its block tables.
`update(layer, slot, start, k, v)` is the contract the reference attention loop calls (the same as
the contiguous cache's): `slot` is the sequence's `SeqSlots` (its block table with the
rows of this step precomputed by the runner). It writes the new k/v rows through the slot
mapping and returns the sequence's whole K/V [start + L, Hkv, D] gathered from its blocks.

fp8 storage (`--kv-cache-dtype fp8`): float8_e4m3fn values with a float32 scale per
token and kv head (amax / 448), dequantized to the compute dtype on read; for MLA that is
one scale per token for c_kv and one for k_pe.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from lowbit.engine.staging import to_device
from lowbit.errors import LowbitError

log = logging.getLogger("lowbit")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
KV_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "float32": torch.float32, "fp8": FP8, "fp8_e4m3": FP8}
CPU_POOL_FRACTION = 0.1  # share of available RAM the KV pool may take on the CPU


@dataclass
class SeqSlots:
    """Where one sequence's tokens live: rows of the flattened pool."""

    block_table: list[int]
    read_rows: torch.Tensor  # [start + L] rows of positions 0..start+L-1
    start: int  # tokens already cached before this step

    @property
    def write_rows(self) -> torch.Tensor:  # [L] rows of the new tokens
        return self.read_rows[self.start:]

    @classmethod
    def build(cls, block_table: list[int], start: int, num_new: int, block_size: int,
              device: torch.device | str) -> SeqSlots:
        pos = torch.arange(start + num_new, device=device)
        table = to_device(block_table, torch.device(device))
        rows = table[pos // block_size] * block_size + pos % block_size
        return cls(block_table, rows, start)


def parse_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name not in KV_DTYPES:
        raise LowbitError(f"unknown --kv-cache-dtype {name!r}; use one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name] or model_dtype


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.k_scale: list[torch.Tensor | None] = [None] * num_layers
        self.v_scale: list[torch.Tensor | None] = [None] * num_layers

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def scratch_row(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8

    def _allocate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # torch.empty: pages the pool never touches cost no memory on the CPU
        shape = ((self.num_blocks + 1) * self.block_size,)
        self.k[layer] = torch.empty(*shape, *k.shape[1:], dtype=self.dtype, device=self.device)
        self.v[layer] = torch.empty(*shape, *v.shape[1:], dtype=self.dtype, device=self.device)
        if self.is_fp8:
            self.k_scale[layer] = torch.empty(*shape, k.shape[1], device=self.device)
            self.v_scale[layer] = torch.empty(*shape, v.shape[1], device=self.device)
        # the scratch block is read by padded graph rows beyond the one row they write:
        # zeros, not whatever the allocator hands back (stale bytes can be NaN, and a NaN
        # row routes to no expert)
        scratch = slice(self.scratch_row, None)
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t[layer] is not None:
                t[layer][scratch].zero_()

    def update(self, layer: int, slot: SeqSlots, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store k/v [L, Hkv, D] at positions start..start+L; return K/V [start+L, Hkv, D]."""
        assert start == slot.start and k.shape[0] == slot.write_rows.shape[0]
        if self.k[layer] is None:
            self._allocate(layer, k, v)
        rows = slot.write_rows
        if self.is_fp8:
            _store_fp8(self.k[layer], self.k_scale[layer], rows, k)
            _store_fp8(self.v[layer], self.v_scale[layer], rows, v)
            return (_load_fp8(self.k[layer], self.k_scale[layer], slot.read_rows, k.dtype),
                    _load_fp8(self.v[layer], self.v_scale[layer], slot.read_rows, v.dtype))
        self.k[layer][rows] = k.to(self.dtype)
        self.v[layer][rows] = v.to(self.dtype)
        return (self.k[layer][slot.read_rows].to(k.dtype),
                self.v[layer][slot.read_rows].to(v.dtype))

    def layer_pool(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """(k, v, block_size, k_scale, v_scale) of one layer, the fields of the kernels'
        KVPool; allocated at the first call from the shapes of k/v [T, Hkv, D]."""
        if self.k[layer] is None:
            self._allocate(layer, k, v)
        return self.k[layer], self.v[layer], self.block_size, self.k_scale[layer], self.v_scale[layer]

    def block_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of one layer as [num_blocks, block_size, Hkv, D], the layout kernels read."""
        k, v = self.k[layer], self.v[layer]
        assert k is not None, "the layer has not been written yet"
        return (k.view(self.num_blocks + 1, self.block_size, *k.shape[1:]),
                v.view(self.num_blocks + 1, self.block_size, *v.shape[1:]))


def _store_fp8(pool: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
    scale = x.float().abs().amax(-1).clamp(min=1e-12) / FP8_MAX  # [L, Hkv]
    pool[rows] = (x.float() / scale[..., None]).to(FP8)
    scales[rows] = scale


def _load_fp8(pool: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype):
    return (pool[rows].float() * scales[rows][..., None]).to(dtype)


# -- sizing -------------------------------------------------------------------------------
def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """The kv heads one of `tp` tensor parallel ranks caches: kv_heads/tp, or one copied
    head when kv_heads < tp (lowbit.distributed.tensor_parallel.shard_attention)."""
    return max(1, kv_heads // tp)


def kv_bytes_per_token(arch, dtype: torch.dtype, num_layers: int, tp: int = 1) -> int:
    """Upper bound on one rank's cache bytes per token over all layers, from the config's
    head shapes, with `tp` tensor parallel ranks (a rank caches only its own kv heads; MLA's
    latent is shared by all heads, so every rank caches all of it)."""
    if arch.kv_lora_rank:  # MLA: c_kv and k_pe, one "head" for all query heads
        heads, dk, dv = 1, arch.kv_lora_rank, arch.qk_rope_head_dim
    else:
        heads, dk, dv = kv_heads_per_rank(arch.num_kv_heads, tp), arch.head_dim, arch.head_dim
    elem = torch.empty((), dtype=dtype).element_size()
    scales = 2 * heads * 4 if dtype == FP8 else 0
    return num_layers * (heads * (dk + dv) * elem + scales)


def available_ram_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def pool_tokens(cfg, arch, dtype: torch.dtype, device: torch.device, num_layers: int,
                activation_bytes: int = 0, extra_per_token: int = 0) -> int:
    """How many tokens the KV pool holds: an explicit knob first, else memory-derived, each
    token costing its KV bytes plus `extra_per_token` (a draft model's pool, as many tokens).
    On CUDA an explicit size must fit the same budget as a derived one (the
    --gpu-memory-utilization share of the card, less what is in use and the step's
    activations): a pool that leaves no room for the activations would fail at the first
    long step, out of memory, with the engine stopped; it is refused at start-up instead."""
    per_token = kv_bytes_per_token(arch, dtype, num_layers, cfg.tensor_parallel_size) + extra_per_token
    explicit = (cfg.num_gpu_blocks_override * cfg.block_size if cfg.num_gpu_blocks_override
                else cfg.kv_cache_tokens)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * cfg.gpu_memory_utilization - (total - free) - activation_bytes
        if explicit:
            if explicit * per_token > budget:
                knob = ("--num-gpu-blocks-override " + str(cfg.num_gpu_blocks_override)
                        if cfg.num_gpu_blocks_override else f"--kv-cache-tokens {cfg.kv_cache_tokens}")
                raise LowbitError(
                    f"{knob}: a KV pool of {explicit} tokens needs {explicit * per_token / 2**30:.1f} GiB, and "
                    f"{max(budget, 0) / 2**30:.1f} GiB is left at --gpu-memory-utilization "
                    f"{cfg.gpu_memory_utilization} ({(total - free) / 2**30:.1f} GiB in use, "
                    f"{activation_bytes / 2**30:.1f} GiB for a step's activations): at most "
                    f"{max(int(budget // per_token), 0)} tokens fit; lower it, or leave it out to size the "
                    f"pool from the memory")
            return explicit
        if budget <= 0:
            raise LowbitError(
                f"no GPU memory left for the KV cache at --gpu-memory-utilization "
                f"{cfg.gpu_memory_utilization}; raise it or lower --max-num-batched-tokens")
        return int(budget // per_token)
    if explicit:
        return explicit
    need = cfg.max_num_seqs * cfg.max_model_len  # no point in more than every sequence full
    return int(min(available_ram_bytes() * CPU_POOL_FRACTION // per_token, need))
