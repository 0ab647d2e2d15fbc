"""DeepSeek-V3 / V2 against transformers, and the V3 MTP draft head (which transformers
drops on load and never saves) against a hand-written tensor set."""

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)

from lowbit.checkpoint.loader import allocate, load_model
from lowbit.engine.batch import ForwardBatch
from lowbit.engine.kv_cache import ContiguousKVCache
from lowbit.errors import LowbitError
from lowbit.models.config import load_config
from tests.models.parity import assert_combine_deferred_exactly, assert_parity, save_tiny

V3_VOCAB, V2_VOCAB = 107, 109
INIT = 0.1  # weights large enough that attention is far from uniform (a wrong scale shows)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.7}


def v3_config(rope_interleave: bool = True) -> DeepseekV3Config:
    # odd sizes (eager experts: transformers' grouped-mm path needs 16-byte strides);
    # layer 0 dense, layers 1-2 MoE with 2 groups of 3 experts, 1 group kept
    return DeepseekV3Config(
        vocab_size=V3_VOCAB, hidden_size=44, intermediate_size=36, moe_intermediate_size=14,
        num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=20,
        kv_lora_rank=18, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=7, n_routed_experts=6,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=dict(YARN), rope_interleave=rope_interleave,
        max_position_embeddings=32, tie_word_embeddings=False, experts_implementation="eager",
        initializer_range=INIT)


def spread_score_bias(model) -> None:
    """Correction biases of both signs, large enough that some biased scores in a kept
    group fall below zero: masking dropped groups with 0 instead of -inf would then pick
    experts from a dropped group."""
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([-0.8, 0.4, -0.7, -0.75, 0.5, -0.9]))


@pytest.mark.parametrize("rope_interleave", [True, False])
def test_deepseek_v3_matches_transformers(tmp_path, rope_interleave):
    hf = save_tiny(DeepseekV3ForCausalLM, v3_config(rope_interleave), tmp_path, prepare=spread_score_bias)
    assert_parity(hf, tmp_path, V3_VOCAB)


def v2_config(topk_method: str = "group_limited_greedy") -> DeepseekV2Config:
    # V2-Lite's shape: no q LoRA (plain q_proj), softmax routing, 2 shared experts; one group
    # of 3 kept (group score: its max), so group-limited and greedy choices differ.
    # transformers' V2 router never renormalises (it ignores norm_topk_prob), so norm_topk_prob=False.
    return DeepseekV2Config(
        vocab_size=V2_VOCAB, hidden_size=40, intermediate_size=30, moe_intermediate_size=10,
        num_hidden_layers=2, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=14,
        qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=5, n_routed_experts=9, num_experts_per_tok=2,
        n_group=3, topk_group=1, topk_method=topk_method, n_shared_experts=2, first_k_dense_replace=1,
        norm_topk_prob=False, routed_scaling_factor=1.5, max_position_embeddings=32,
        rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}, experts_implementation="eager",
        initializer_range=INIT)


@pytest.mark.parametrize("topk_method", ["group_limited_greedy", "greedy"])
def test_deepseek_v2_matches_transformers(tmp_path, topk_method):
    hf = save_tiny(DeepseekV2ForCausalLM, v2_config(topk_method), tmp_path)
    assert_parity(hf, tmp_path, V2_VOCAB)


# -- MTP ---------------------------------------------------------------------------------

def mtp_tensors(base: dict[str, torch.Tensor], N: int, D: int) -> dict[str, torch.Tensor]:
    """The published MTP layout: model.layers.{N}.* = a decoder layer shaped like the last
    (MoE) layer, enorm, hnorm, eh_proj [D, 2D], shared_head.norm, and copies of the main
    embedding and head."""
    g = torch.Generator().manual_seed(3)
    last = f"model.layers.{N - 1}."
    out = {f"model.layers.{N}.{k[len(last):]}": torch.randn(v.shape, generator=g) * 0.1
           for k, v in base.items() if k.startswith(last)}
    p = f"model.layers.{N}."
    out |= {p + "enorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
            p + "hnorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
            p + "eh_proj.weight": torch.randn(D, 2 * D, generator=g) * 0.1,
            p + "shared_head.norm.weight": 1 + 0.1 * torch.randn(D, generator=g),
            p + "shared_head.head.weight": base["lm_head.weight"].clone(),
            p + "embed_tokens.weight": base["model.embed_tokens.weight"].clone()}
    return out


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv3")
    save_tiny(DeepseekV3ForCausalLM, v3_config(), path, prepare=spread_score_bias)
    return path


def test_transformers_checkpoint_without_mtp_loads(v3_dir):
    lm = load_model(v3_dir, dtype="float32").model
    assert lm.config.num_nextn_predict_layers == 1  # transformers writes it, yet saves no MTP tensors
    assert lm.mtp is None and lm.num_cache_layers == lm.config.num_layers
    with pytest.raises(LowbitError, match="no MTP layer"):
        lm.mtp_forward(torch.zeros(1, 44), torch.zeros(1, dtype=torch.long), None)


def test_mtp_layer_loads_and_drafts(v3_dir):
    cfg = load_config(v3_dir)
    base = load_file(str(v3_dir / "model.safetensors"))
    extra = mtp_tensors(base, cfg.num_layers, cfg.hidden_size)
    lm = allocate(cfg, torch.float32, "cpu")
    lm.load_weights(iter({**base, **extra}.items()))
    N, D = cfg.num_layers, cfg.hidden_size
    assert lm.num_cache_layers == N + 1
    assert lm.mtp.eh_proj.weight.shape == (D, 2 * D)
    assert torch.equal(lm.mtp.eh_proj.weight, extra[f"model.layers.{N}.eh_proj.weight"])
    assert lm.mtp.mlp.experts.w13.shape == (cfg.num_experts, 2 * cfg.moe_intermediate_size, D)

    ids = torch.randint(0, V3_VOCAB, (13,), generator=torch.Generator().manual_seed(4))

    def draft(bounds: list[int]) -> torch.Tensor:  # per chunk: main pass, then the MTP pass
        cache, outs = ContiguousKVCache(lm.num_cache_layers, 1, 12), []
        for a, b in zip(bounds, bounds[1:]):
            batch = ForwardBatch.build([b - a], [a], [0], cache)
            outs.append(lm.mtp_forward(lm(ids[a:b], batch), ids[a + 1:b + 1], batch))
        return torch.cat(outs)

    with torch.no_grad():
        whole, chunked = draft([0, 12]), draft([0, 5, 12])
    assert whole.shape == (12, V3_VOCAB) and torch.isfinite(whole).all()
    assert (whole - chunked).abs().max() < 1e-4  # the MTP layer reads its own cache slot


def test_partial_mtp_layer_is_an_error(v3_dir):
    cfg = load_config(v3_dir)
    base = load_file(str(v3_dir / "model.safetensors"))
    extra = mtp_tensors(base, cfg.num_layers, cfg.hidden_size)
    del extra[f"model.layers.{cfg.num_layers}.eh_proj.weight"]
    lm = allocate(cfg, torch.float32, "cpu")
    with pytest.raises(LowbitError, match="mtp.eh_proj.weight"):
        lm.load_weights(iter({**base, **extra}.items()))


# -- absorbed weights ----------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["nvfp4", "int4-g32", "fp8"])
def test_quantized_kv_b_proj_is_decoded_once_and_matches_its_dense_twin(v3_dir, fmt):
    """Attention reads kv_b_proj per head (absorbed into q and out of the latent): from a
    quantized weight it decodes it once, keeps it, and computes what the decoded weight
    held as a plain tensor computes."""
    from lowbit.formats import get_format

    ids = torch.randint(0, V3_VOCAB, (11,), generator=torch.Generator().manual_seed(5))

    def logits(lm) -> torch.Tensor:
        cache = ContiguousKVCache(lm.num_cache_layers, 1, len(ids))
        with torch.no_grad():
            return torch.cat([lm.compute_logits(lm(ids[a:b], ForwardBatch.build([b - a], [a], [0], cache)))
                              for a, b in ((0, 7), (7, 10), (10, 11))])  # prefill, extend, decode

    quant, dense = load_model(v3_dir, dtype="float32").model, load_model(v3_dir, dtype="float32").model
    for qa, da in zip((lay.self_attn for lay in quant.model.layers), (lay.self_attn for lay in dense.model.layers)):
        qt = get_format(fmt).quantize(qa.kv_b_proj.weight.data)
        qa.kv_b_proj.set_quantized_weight(qt)
        da.kv_b_proj.weight.copy_(qt.dequantize(torch.float32))
    got, want = logits(quant), logits(dense)
    assert (got - want).abs().max() < 1e-5
    attn = quant.model.layers[0].self_attn
    kept = attn.absorbed_weight(torch.float32)
    assert kept is attn.absorbed_weight(torch.float32) and kept.shape == (attn.H, attn.Dn + attn.Dv, attn.C)
    assert dense.model.layers[0].self_attn.absorbed_weight(torch.float32).data_ptr() == \
        dense.model.layers[0].self_attn.kv_b_proj.weight.data_ptr()  # a float32 weight is used as it is


def test_latent_attention_and_router_go_through_the_registry(v3_dir):
    """Every hot op of an MLA model is a counted door call: latent attention, the router
    (grouped scoring), the norms."""
    from lowbit.kernels import routes

    lm = load_model(v3_dir, dtype="float32").model
    routes.reset_counters()
    ids = torch.tensor([1, 5, 9, 2])
    with torch.inference_mode():
        lm(ids, ForwardBatch.build([4], [0], None))
    calls = {(c["op"], c["route"]) for c in routes.counters()["route_calls"]}
    assert {("latent_attention", "torch"), ("router", "torch"), ("norm", "torch")} <= calls
    layers = {c["layer"] for c in routes.counters()["route_calls"] if c["op"] == "latent_attention"}
    assert len(layers) == lm.config.num_layers


# -- serving layout ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def v2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv2")
    save_tiny(DeepseekV2ForCausalLM, v2_config(), path)
    return path


@pytest.mark.parametrize("version", ["v2", "v3"])
@pytest.mark.parametrize("fmt", [None, "int4-g32", "nvfp4", "fp8"])
def test_serving_layout_gives_the_same_logits(v2_dir, v3_dir, version, fmt):
    """prepare_for_serving merges q_proj (V2) or q_a_proj (V3) with kv_a_proj_with_mqa into one
    projection (plain rows, or LUT rows keeping their own tables; fp8 has no LUT view, so
    those stay two) and the shared experts' gate and up into one: the
    logits do not move (the dense layer's MLP merges its gate and up too). Prefill, extend and
    decode steps over a contiguous cache."""
    from lowbit.formats import get_format

    lm = load_model(v2_dir if version == "v2" else v3_dir, dtype="float32").model
    first = "q_proj" if version == "v2" else "q_a_proj"
    if fmt is not None:
        for layer in lm.model.layers:
            for name in (first, "kv_a_proj_with_mqa"):
                lin = getattr(layer.self_attn, name)
                lin.set_quantized_weight(get_format(fmt).quantize(lin.weight.data))
    ids = torch.randint(0, lm.config.vocab_size, (11,), generator=torch.Generator().manual_seed(6))

    def logits() -> torch.Tensor:
        cache = ContiguousKVCache(lm.num_cache_layers, 1, len(ids))
        with torch.no_grad():
            return torch.cat([lm.compute_logits(lm(ids[a:b], ForwardBatch.build([b - a], [a], [0], cache)))
                              for a, b in ((0, 7), (7, 10), (10, 11))])

    before = logits()
    lm.prepare_for_serving()
    attn = lm.model.layers[0].self_attn
    merged = fmt != "fp8"
    assert (attn.qkv_a_proj is not None) == merged and (getattr(attn, first) is None) == merged
    for mlp in (lm.model.layers[0].mlp, lm.model.layers[-1].mlp.shared_experts):  # dense, shared
        assert mlp.gate_up_proj is not None
        assert mlp.gate_proj.weight.data_ptr() == mlp.gate_up_proj.weight.data_ptr()  # a view, no copy
    torch.testing.assert_close(logits(), before, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU")
def test_moe_combine_and_shared_experts_deferred_into_the_next_norm(v3_dir, monkeypatch):
    """On the grouped MoE route a MoE layer with shared experts hands its unsummed slot rows
    and the shared MLP's output (a SlotSum with its extra) to the next RMSNorm: no combine
    launch, and the logits equal those with the combine launch (LOWBIT_SLOT_FUSION=0) bit for
    bit, with the norm on its Triton route and on the torch route."""
    lm = load_model(v3_dir, dtype="float32").model
    ids = torch.randint(0, lm.config.vocab_size, (11,), generator=torch.Generator().manual_seed(8))

    def logits() -> torch.Tensor:
        cache = ContiguousKVCache(lm.num_cache_layers, 1, len(ids))
        with torch.no_grad():
            return torch.cat([lm.compute_logits(lm(ids[a:b], ForwardBatch.build([b - a], [a], [0], cache)))
                              for a, b in ((0, 7), (7, 11))])

    assert_combine_deferred_exactly(monkeypatch, logits, combines_each=4)
