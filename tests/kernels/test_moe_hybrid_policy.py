"""Hybrid expert stacks end to end: the --hybrid spec, quantize-on-load by parts, the
artifact round trip, and the model's MoE layers reading the HybridTensor stacks."""

import json

import pytest
import torch

from lowbit.checkpoint.artifact import write_artifact
from lowbit.checkpoint.loader import load_model
from lowbit.engine.batch import ForwardBatch
from lowbit.errors import LowbitError
from lowbit.formats.hybrid import HybridTensor
from lowbit.layers.moe import Experts
from lowbit.quantize.policy import HybridSpec, plan_hybrid, router_frequency

IDS = torch.tensor([5, 17, 40, 3, 99, 120, 7, 64, 31, 200, 11, 2])


def _logits(loaded):
    batch = ForwardBatch.build([len(IDS)], [0], None, None, "cpu")
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(IDS, batch))


def test_spec_parse_and_order():
    s = HybridSpec.parse("hot=nvfp4:2, cold=nf3")
    assert (s.hot_format, s.hot_count, s.cold_format) == ("nvfp4", 2, "nf3")
    assert s.hot_experts("model.layers.0.mlp.experts.w13", 4) == [0, 1]
    s.order["model.layers.0.mlp"] = [3, 1, 0, 2]
    assert s.hot_experts("model.layers.0.mlp.experts.w13", 4) == [1, 3]
    assert s.hot_experts("model.layers.1.mlp.experts.w2", 4) == [0, 1]
    for bad in ("hot=nvfp4,cold=nf3", "cold=nf3", "hot=nvfp4:x,cold=nf3", "hot=nope:2,cold=nf3"):
        with pytest.raises(LowbitError):
            HybridSpec.parse(bad)
    ids = torch.tensor([[2, 0], [2, 3], [2, 0]])
    assert router_frequency(ids, 4) == [2, 0, 3, 1]


def test_quantize_on_load_and_artifact_round_trip(tiny_moe_dir, tmp_path, monkeypatch):
    import lowbit.checkpoint.loader as loader

    spec = HybridSpec.parse("hot=nvfp4:1,cold=nf3")
    spec.order[""] = [2, 0, 1, 3]
    plan = loader._plan
    monkeypatch.setattr(loader, "_plan", lambda m, q, lm: plan_hybrid(m, plan(m, q, lm), spec))
    a = load_model(tiny_moe_dir, dtype="float32", quantization="nvfp4")
    monkeypatch.undo()
    stacks = [m.w13 for m in a.model.modules() if isinstance(m, Experts)]
    assert stacks and all(isinstance(w, HybridTensor) for w in stacks)
    assert stacks[0].members == {"hot": [2], "cold": [0, 1, 3]}
    assert stacks[0].parts["hot"].format.name == "nvfp4" and stacks[0].parts["cold"].format.name == "nf3"
    out = tmp_path / "hybrid"
    raw = json.loads((tiny_moe_dir / "config.json").read_text())
    manifest = write_artifact(a.model, out, source=tiny_moe_dir, raw_config=raw, fmt="nvfp4",
                              dense_reasons={}, provenance={}, source_dtype=torch.float32,
                              max_shard_bytes=1 << 20)
    entry = manifest["tensors"]["model.layers.0.mlp.experts.w2"]
    assert entry["format"] == "hybrid" and entry["parts"]["hot"]["experts"] == [2]
    b = load_model(out, dtype="float32")
    assert isinstance(next(m for m in b.model.modules() if isinstance(m, Experts)).w13, HybridTensor)
    la, lb = _logits(a), _logits(b)
    assert torch.isfinite(la).all() and torch.equal(la, lb)
