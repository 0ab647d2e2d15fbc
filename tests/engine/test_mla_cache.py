"""DeepSeek-V3 / V2 MLA in the serving engine: the paged cache holds the compressed latent
(c_kv, k_pe) and attention runs with absorbed weights; transformers, which attends over
per-head K/V, is the reference for every generated token."""

import pytest
import torch
from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

from lowbit.config import EngineConfig
from lowbit.engine.batch import ForwardBatch, ForwardMode
from lowbit.engine.engine import LLMEngine
from lowbit.engine.kv_cache import ContiguousKVCache
from lowbit.engine.paged_cache import FP8, kv_bytes_per_token
from lowbit.engine.sampling import SamplingParams
from tests.engine.helpers import run_all, tokens_of
from tests.engine.tiny_model import build_tokenizer
from tests.models.parity import save_tiny
from tests.models.test_deepseek_v3 import spread_score_bias, v2_config, v3_config

BLOCK = 4
PREFIX = list(range(10, 23))  # 13 tokens: 3 full blocks another prompt can share
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)  # 19-20 < 32 positions
FAMILIES = {"deepseek_v3": (DeepseekV3ForCausalLM, v3_config, spread_score_bias),
            "deepseek_v2": (DeepseekV2ForCausalLM, v2_config, None)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def mla(request, tmp_path_factory):
    hf_cls, config, prepare = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(hf_cls, config(), path, prepare=prepare)
    build_tokenizer(path)
    return path, hf


def make_engine(path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), block_size=BLOCK, kv_cache_tokens=256, **overrides))


def hf_logprobs(hf):
    def run(ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, V]
        with torch.no_grad():
            return torch.log_softmax(hf(ids[None]).logits[0].float(), -1)
    return run


def logprob_error(reference, prompt: list[int], deltas) -> tuple[float, float]:
    """(max |engine logprob - reference logprob| of each generated token, max gap from the
    token to the reference's best), the reference being one forward over prompt + output."""
    toks = tokens_of(deltas)
    got = torch.tensor([lp.logprob for d in deltas for lp in d.logprobs])
    ref = reference(torch.tensor(prompt + toks))[len(prompt) - 1:-1]  # [n, V]: row i predicts toks[i]
    chosen = ref.gather(1, torch.tensor(toks)[:, None])[:, 0]  # [n]
    return (chosen - got).abs().max().item(), (ref.amax(-1) - chosen).max().item()


def assert_matches(reference, prompt: list[int], deltas, tol: float) -> None:
    """Logprobs within tol of the reference's, and each token its argmax up to tol (a
    float32 near-tie may go either way)."""
    err, gap = logprob_error(reference, prompt, deltas)
    assert err < tol, f"max |logprob diff| {err:.2e}"
    assert gap < tol, f"{tokens_of(deltas)} are not the reference's greedy tokens (gap {gap:.2e})"


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """The fp8 cache layout written out: e4m3 codes of x / scale, scale = amax / 448 per
    token and head (for MLA's latent: per token, for c_kv and for k_pe)."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    return ((x.float() / scale).to(FP8).float() * scale).to(x.dtype)


class Fp8ContiguousCache(ContiguousKVCache):
    def update(self, layer, slot, start, k, v):
        return super().update(layer, slot, start, fp8_round_trip(k), fp8_round_trip(v))


def lowbit_fp8_logprobs(lm):
    """The non-engine forward of the same model over a contiguous cache that rounds what it
    stores as the fp8 pool does."""
    def run(ids: torch.Tensor) -> torch.Tensor:
        cache = Fp8ContiguousCache(lm.num_cache_layers, 1, len(ids))
        with torch.no_grad():
            hidden = lm(ids, ForwardBatch.build([len(ids)], [0], [0], cache))
            return torch.log_softmax(lm.compute_logits(hidden), -1)
    return run


def run_batch(engine: LLMEngine) -> list[tuple[list[int], list]]:
    """One request alone (it fills the prefix cache), then three at once: two share its
    first three blocks, all prefill in chunks beside each other's decodes."""
    rid = engine.add_request(PREFIX + [1], GREEDY).request_id
    runs = [(PREFIX + [1], run_all(engine)[rid])]
    prompts = [PREFIX + [2], PREFIX + [3, 4], [7, 8, 9, 30, 31]]
    rids = [engine.add_request(p, GREEDY).request_id for p in prompts]
    out = run_all(engine)
    assert [out[r][-1].num_cached_tokens for r in rids] == [3 * BLOCK, 3 * BLOCK, 0]
    return runs + [(p, out[r]) for p, r in zip(prompts, rids)]


def test_engine_decodes_like_transformers_batched_and_after_a_prefix_hit(mla):
    path, hf = mla
    engine = make_engine(path, max_num_batched_tokens=10)
    modes = []
    engine.runner.before_forward.append(lambda batch, ids: modes.append((batch.mode, batch.num_seqs)))
    for prompt, deltas in run_batch(engine):
        assert_matches(hf_logprobs(hf), prompt, deltas, tol=1e-4)
    assert (ForwardMode.DECODE, 3) in modes and (ForwardMode.MIXED, 3) in modes


def test_pool_holds_the_latent_and_nothing_per_head(mla):
    path, _ = mla
    engine = make_engine(path)
    engine.add_request(PREFIX, GREEDY)
    run_all(engine)
    arch, cache = engine.arch, engine.kv_cache
    layers = engine.model.num_cache_layers
    row_bytes = 0
    for k, v in zip(cache.k, cache.v):
        assert k.shape == (cache.scratch_row + BLOCK, 1, arch.kv_lora_rank)  # c_kv
        assert v.shape == (cache.scratch_row + BLOCK, 1, arch.qk_rope_head_dim)  # k_pe
        row_bytes += (k[0].numel() + v[0].numel()) * k.element_size()
    assert row_bytes == kv_bytes_per_token(arch, cache.dtype, layers)
    assert row_bytes == (arch.kv_lora_rank + arch.qk_rope_head_dim) * layers * 4  # float32


def test_fp8_latent_cache_matches_its_reference_and_stays_near_transformers(mla):
    path, hf = mla
    engine = make_engine(path, kv_cache_dtype="fp8", max_num_batched_tokens=10)
    runs = run_batch(engine)
    cache = engine.kv_cache
    assert cache.k[0].dtype == FP8 and cache.v[0].dtype == FP8
    assert cache.k_scale[0].shape == cache.v_scale[0].shape == (cache.scratch_row + BLOCK, 1)  # per token
    for prompt, deltas in runs:
        assert_matches(lowbit_fp8_logprobs(engine.model), prompt, deltas, tol=1e-3)
    # against float32 attention: e4m3 keeps 3 mantissa bits, and this tiny random model is
    # sensitive (per-head fp8 K/V moved its logprobs by up to 1.9 on random prompts)
    err = max(logprob_error(hf_logprobs(hf), p, d)[0] for p, d in runs)
    assert err < 1.0
