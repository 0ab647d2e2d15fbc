import pytest
import torch

from lowbit.engine.kv_cache import ContiguousKVCache
from lowbit.engine.paged_cache import PagedKVCache, SeqSlots, kv_bytes_per_token


def _steps(gen: torch.Generator, lengths: list[int], hkv: int, dk: int, dv: int):
    return [(torch.randn(n, hkv, dk, generator=gen), torch.randn(n, hkv, dv, generator=gen)) for n in lengths]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_update_matches_the_contiguous_cache(block_size):
    """Same contract: chunks written at growing offsets read back the whole sequence,
    here through a scrambled block table and with different k and v head dims (MLA)."""
    gen = torch.Generator().manual_seed(0)
    lengths, hkv, dk, dv = [5, 1, 7, 1, 1], 2, 6, 3
    total = sum(lengths)
    blocks = -(-total // block_size)
    table = torch.randperm(blocks + 3, generator=gen)[:blocks].tolist()
    paged = PagedKVCache(num_layers=2, num_blocks=blocks + 3, block_size=block_size,
                         dtype=torch.float32, device="cpu")
    ref = ContiguousKVCache(num_layers=2, num_slots=1, max_len=total)
    start = 0
    for k, v in _steps(gen, lengths, hkv, dk, dv):
        slot = SeqSlots.build(table, start, k.shape[0], block_size, "cpu")
        got = paged.update(1, slot, start, k, v)
        want = ref.update(1, 0, start, k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        start += k.shape[0]
    assert paged.k[0] is None  # layers allocate on their first write


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_scratch_block_is_zero_whatever_the_allocator_returns(monkeypatch, dtype):
    """Padded graph rows read the scratch block past the one row they write: it must hold
    finite zeros even when the allocator hands back stale bytes (here NaN everywhere)."""
    real_empty = torch.empty

    def stale_empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", stale_empty)
    cache = PagedKVCache(1, num_blocks=3, block_size=4, dtype=dtype, device="cpu")
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    cache.update(0, SeqSlots.build([1], 0, 2, 4, "cpu"), 0, k, v)
    tensors = [cache.k[0], cache.v[0]] + ([cache.k_scale[0], cache.v_scale[0]] if cache.is_fp8 else [])
    for t in tensors:
        assert t.shape[0] == 4 * 4
        scratch = t[cache.scratch_row:].float()
        assert scratch.shape[0] == 4 and torch.equal(scratch, torch.zeros_like(scratch))
    assert torch.isnan(cache.k[0][:4].float()).all()  # the stand-in did hand back NaN


def test_fp8_cache_round_trips_within_fp8_precision():
    gen = torch.Generator().manual_seed(1)
    cache = PagedKVCache(1, num_blocks=4, block_size=4, dtype=torch.float8_e4m3fn, device="cpu")
    k = torch.randn(10, 2, 8, generator=gen) * torch.tensor([0.01, 100.0])[None, :, None]  # per-head ranges
    v = torch.randn(10, 2, 8, generator=gen)
    slot = SeqSlots.build([2, 0, 3], 0, 10, 4, "cpu")
    kk, vv = cache.update(0, slot, 0, k, v)
    assert cache.k[0].dtype == torch.float8_e4m3fn
    for got, want in ((kk, k), (vv, v)):
        rel = (got - want).abs().amax(-1) / want.abs().amax(-1)
        assert rel.max() < 1 / 16  # e4m3 keeps 3 mantissa bits; scales are per token and head


def test_bytes_per_token_counts_both_tensors_and_fp8_scales(tiny_model):
    from lowbit.models.config import load_config

    arch = load_config(tiny_model)
    per_layer = arch.num_kv_heads * 2 * arch.head_dim
    assert kv_bytes_per_token(arch, torch.float32, 2) == 2 * per_layer * 4
    assert kv_bytes_per_token(arch, torch.float8_e4m3fn, 2) == 2 * (per_layer + 2 * arch.num_kv_heads * 4)
    one_head = 2 * 2 * arch.head_dim * 4  # 2 layers, k and v, float32
    assert kv_bytes_per_token(arch, torch.float32, 2, tp=arch.num_kv_heads) == one_head  # a rank's own heads
    assert kv_bytes_per_token(arch, torch.float32, 2, tp=2 * arch.num_kv_heads) == one_head  # one copied head


def test_mla_bytes_per_token_count_the_latent_once_for_all_heads():
    from pathlib import Path

    import lowbit
    from lowbit.models.config import load_config

    arch = load_config(Path(lowbit.__file__).parent / "model_configs" / "deepseek-ai__DeepSeek-V3.json")
    C, Dr, L = arch.kv_lora_rank, arch.qk_rope_head_dim, arch.num_layers
    assert (C, Dr, L) == (512, 64, 61)
    latent = kv_bytes_per_token(arch, torch.bfloat16, L)
    assert latent == (C + Dr) * L * 2
    assert kv_bytes_per_token(arch, torch.float8_e4m3fn, L) == (C + Dr + 2 * 4) * L  # scales: c_kv, k_pe
    per_head = arch.num_heads * (arch.qk_nope_head_dim + Dr + arch.v_head_dim) * L * 2  # uncompressed K/V
    assert per_head / latent == pytest.approx(71.1, abs=0.05)  # tokens the same pool holds
    assert kv_bytes_per_token(arch, torch.bfloat16, L, tp=8) == latent  # every rank caches the whole latent


def test_an_explicit_pool_that_leaves_no_room_for_activations_is_refused_at_start_up(monkeypatch, tiny_model):
    """On CUDA, --kv-cache-tokens / --num-gpu-blocks-override must fit the memory budget (the
    utilization share less what is in use and the activations): a pool too big for it is a
    clear start-up error, not an out-of-memory failure at the first long step. The card is
    faked: mem_get_info is the only CUDA call pool_tokens makes."""
    from lowbit.config import EngineConfig
    from lowbit.engine.paged_cache import pool_tokens
    from lowbit.errors import LowbitError
    from lowbit.models.config import load_config

    arch = load_config(tiny_model)
    per = kv_bytes_per_token(arch, torch.bfloat16, 2)
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 80 * gib))  # 50 GiB in use
    cuda = torch.device("cuda")
    act = 2 * gib
    budget = 80 * gib * 0.9 - 50 * gib - act  # 20 GiB
    fits = int(budget // per)
    cfg = EngineConfig(model="x", kv_cache_tokens=fits)
    assert pool_tokens(cfg, arch, torch.bfloat16, cuda, 2, act) == fits
    assert pool_tokens(EngineConfig(model="x"), arch, torch.bfloat16, cuda, 2, act) == fits  # derived: the same
    with pytest.raises(LowbitError, match=rf"--kv-cache-tokens {fits + 1}: .* at most {fits} tokens fit"):
        pool_tokens(EngineConfig(model="x", kv_cache_tokens=fits + 1), arch, torch.bfloat16, cuda, 2, act)
    blocks = EngineConfig(model="x", num_gpu_blocks_override=fits // 16 + 1, block_size=16)
    with pytest.raises(LowbitError, match="--num-gpu-blocks-override"):
        pool_tokens(blocks, arch, torch.bfloat16, cuda, 2, act)
    # on the CPU an explicit size is taken as given
    assert pool_tokens(EngineConfig(model="x", kv_cache_tokens=fits + 1), arch, torch.bfloat16,
                       torch.device("cpu"), 2) == fits + 1
