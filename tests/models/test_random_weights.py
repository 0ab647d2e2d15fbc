"""Every family from the published config.json files in lowbit/model_configs: at full size
on the meta device (parameter counts against the published totals), and shrunk (fewer
layers and experts, small widths) end to end with random weights."""

import json
from pathlib import Path

import pytest
import torch

import lowbit
from lowbit.checkpoint.loader import allocate, load_model
from lowbit.engine.batch import ForwardBatch
from lowbit.engine.kv_cache import ContiguousKVCache
from lowbit.models import param_counts
from lowbit.models.config import ArchConfig

CONFIGS = Path(lowbit.__file__).parent / "model_configs"
B = 1e9
# published (total, active) in billions; active None where no count is published with
# enough digits. "embed": whether the publisher counts the input embedding as active
# (Qwen and Mistral do; DeepSeek and OpenAI do not).
PUBLISHED = {
    "Qwen__Qwen3-0.6B": dict(total=0.6, active=None),
    "Qwen__Qwen3-30B-A3B": dict(total=30.5, active=3.3, embed=True),
    "Qwen__Qwen3-235B-A22B": dict(total=235.0, active=22.0, embed=True),
    "mistralai__Mixtral-8x7B-v0.1": dict(total=46.7, active=12.9, embed=True),
    "deepseek-ai__DeepSeek-V2-Lite": dict(total=15.7, active=None),
    # the hub's 685B = 671B main model + the MTP layer, with the MTP's copies of the
    # embedding and head (0.93B each) that lowbit shares with the main model
    "deepseek-ai__DeepSeek-V3": dict(total=685.0, active=None),
    "openai__gpt-oss-20b": dict(total=20.91, active=3.61, embed=False),
    "openai__gpt-oss-120b": dict(total=116.83, active=5.13, embed=False),
}


def raw_config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def test_every_shipped_config_is_checked():
    assert sorted(p.stem for p in CONFIGS.glob("*.json")) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_counts_match_published(name):
    cfg = ArchConfig.from_dict(raw_config(name))
    total, active = param_counts(cfg)
    pub = PUBLISHED[name]
    assert total / B == pytest.approx(pub["total"], rel=0.02)
    if pub["active"] is not None:
        embed = 0 if pub["embed"] else cfg.vocab_size * cfg.hidden_size
        assert (active - embed) / B == pytest.approx(pub["active"], rel=0.02)


def test_deepseek_v3_main_model_and_mtp():
    raw = raw_config("deepseek-ai__DeepSeek-V3")
    main_total, main_active = param_counts(ArchConfig.from_dict({**raw, "num_nextn_predict_layers": 0}))
    assert main_total / B == pytest.approx(671, rel=0.02)
    # 36.6B active per DeepSeek's weight notes: everything but the input embedding
    assert (main_active - raw["vocab_size"] * raw["hidden_size"]) / B == pytest.approx(36.6, rel=0.02)
    total, _ = param_counts(ArchConfig.from_dict(raw))
    assert (total - main_total) / B == pytest.approx(11.5, rel=0.02)  # "11.5B unique parameters"


@pytest.mark.parametrize("name", ["deepseek-ai__DeepSeek-V3", "openai__gpt-oss-20b"])
def test_meta_allocation_holds_no_memory(name):
    cfg = ArchConfig.from_dict(raw_config(name))
    m = allocate(cfg, torch.bfloat16, "meta")
    params = list(m.parameters())
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in params)
    assert sum(p.numel() for p in params) == param_counts(cfg)[0]


# -- shrunk copies, end to end -------------------------------------------------------------
def shrink(raw: dict) -> dict:
    """Same architecture, toy size: 3 layers, 8 experts (4 active), hidden 64, vocab 256."""
    r = {k: v for k, v in raw.items() if k != "quantization_config"}
    r.update(hidden_size=64, vocab_size=256, num_attention_heads=4, num_hidden_layers=3,
             intermediate_size=96, bos_token_id=None, eos_token_id=None)
    if "num_key_value_heads" in r:
        r["num_key_value_heads"] = 2
    if r.get("head_dim"):
        r["head_dim"] = 16
    for k in ("num_experts", "num_local_experts", "n_routed_experts"):
        if r.get(k):
            r[k] = 8
    for k in ("num_experts_per_tok", "experts_per_token"):
        if r.get(k):
            r[k] = min(r[k], 4)
    if r.get("moe_intermediate_size"):
        r["moe_intermediate_size"] = 32
    if r["model_type"] in ("deepseek_v2", "deepseek_v3"):
        r.update(first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                 v_head_dim=16)
        if r.get("q_lora_rank"):
            r["q_lora_rank"] = 48
        if (r.get("n_group") or 1) > 1:
            r.update(n_group=4, topk_group=2)
    if r["model_type"] in ("gpt_oss", "mixtral"):
        r["intermediate_size"] = 32  # the expert width
    if r.get("layer_types"):
        r["layer_types"] = r["layer_types"][:3]
    if r.get("sliding_window"):
        r["sliding_window"] = 4  # the 11-token prompt crosses it
    return r


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shrunk_model_runs_with_random_weights(tmp_path, name):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(shrink(raw_config(name))))
    lm = load_model(path, random_weights=True, config=path, dtype="bfloat16").model
    assert lm.config.model_type == raw_config(name)["model_type"]
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(0))
    cache = ContiguousKVCache(lm.num_cache_layers, 1, 12)
    with torch.no_grad():
        prefill = ForwardBatch.build([11], [0], [0], cache)
        hidden = lm(ids[:11], prefill)  # [11, D]
        logits = lm.compute_logits(hidden)
        step = lm.compute_logits(lm(ids[11:], ForwardBatch.build([1], [11], [0], cache)))
        if getattr(lm, "mtp", None) is not None:  # DeepSeek-V3's draft head
            draft = lm.mtp_forward(hidden, ids[1:12], prefill)
            assert draft.shape == (11, 256) and torch.isfinite(draft).all()
    assert logits.shape == (11, 256) and step.shape == (1, 256)
    assert torch.isfinite(logits).all() and torch.isfinite(step).all()
    assert logits.std() > 0
