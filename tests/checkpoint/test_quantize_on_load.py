import json

import pytest
import torch

from lowbit.checkpoint.loader import load_model
from lowbit.checkpoint.quant_plan import quantized_weights
from lowbit.cli import main
from lowbit.engine.batch import ForwardBatch
from lowbit.errors import LowbitError
from lowbit.formats import FORMATS, QuantizedTensor

IDS = torch.tensor([5, 17, 40, 3, 99, 120, 7, 64, 31, 200, 11, 2])


def logits(loaded):
    batch = ForwardBatch.build([len(IDS)], [0], None, None, "cpu")
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(IDS, batch))


def dense_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_policy_quantizes_linears_and_experts_only(tiny_moe_dir):
    lm = load_model(tiny_moe_dir, dtype="float32", quantization="nvfp4")
    q = quantized_weights(lm.model)
    assert "model.layers.0.mlp.experts.w13" in q and "model.layers.1.mlp.experts.w2" in q
    assert "model.layers.0.self_attn.q_proj.weight" in q and "model.layers.1.self_attn.o_proj.weight" in q
    assert all(isinstance(v, QuantizedTensor) and v.format.name == "nvfp4" for v in q.values())
    dense = lm.plan.dense
    assert dense["model.layers.0.mlp.gate.weight"].startswith("router gate")
    assert dense["model.embed_tokens.weight"].startswith("embedding")
    assert dense["lm_head.weight"].startswith("lm_head")
    assert dense["model.norm.weight"] == "norm scale"
    assert set(q) | set(dense) == set(lm.plan.quantized) | set(dense)
    assert not any(p.device.type == "meta" for p in lm.model.parameters())
    assert lm.weight_format.startswith("nvfp4 (") and "bits/weight" in lm.weight_format
    head = load_model(tiny_moe_dir, dtype="float32", quantization="nvfp4", quantize_lm_head=True)
    assert isinstance(head.model.lm_head.weight, QuantizedTensor)
    assert torch.isfinite(logits(head)).all()


def test_quantized_logits_track_the_dense_model(tiny_moe_dir):
    ref = logits(load_model(tiny_moe_dir, dtype="float32"))
    err = {}
    for fmt in ("fp8", "nvfp4", "nf3"):
        out = logits(load_model(tiny_moe_dir, dtype="float32", quantization=fmt))
        err[fmt] = float((out - ref).norm() / ref.norm())
    assert err["fp8"] < 0.05 < 0.1 < err["nf3"]  # 8 bits is close, 3 bits clearly off
    assert err["fp8"] < err["nvfp4"] < err["nf3"] < 0.5


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_loads_and_runs(tiny_moe_dir, fmt):
    lm = load_model(tiny_moe_dir, dtype="float32", quantization=fmt)
    assert lm.weight_format.startswith(f"{fmt} (")
    assert {q.format.name for q in quantized_weights(lm.model).values()} == {fmt}
    assert torch.isfinite(logits(lm)).all()


def test_never_holds_the_dense_model_on_the_device(tiny_moe_dir):
    dense = load_model(tiny_moe_dir, dtype="float32")
    full = dense_bytes(dense.model)
    assert dense.stats.peak_device_bytes == full  # the plain load materialises each weight once
    lm = load_model(tiny_moe_dir, dtype="float32", quantization="nvfp4")
    held = dense_bytes(lm.model) + sum(q.nbytes for q in quantized_weights(lm.model).values())
    assert lm.stats.device_bytes == held
    biggest = max(p.numel() * 4 for p in dense.model.parameters())
    assert lm.stats.peak_device_bytes <= held + biggest  # one dense weight in flight at most
    assert lm.stats.peak_device_bytes < 0.75 * full
    assert lm.stats.quantized == len(lm.plan.quantized)


def test_random_weights_quantize_per_parameter(tiny_moe_dir):
    cfg = tiny_moe_dir / "config.json"
    dense = load_model("x", random_weights=True, config=cfg, dtype="float32")
    q = load_model("x", random_weights=True, config=cfg, dtype="float32", quantization="fp8")
    # the same seeded values: dense parameters equal, quantized ones decode close to them
    assert torch.equal(q.model.model.embed_tokens.weight, dense.model.model.embed_tokens.weight)
    w = dense.model.model.layers[0].mlp.experts.w13
    got = q.model.model.layers[0].mlp.experts.w13.dequantize(torch.float32)
    assert float((got - w).abs().max()) <= float(w.abs().max()) / 16
    assert q.weight_format.startswith("fp8 (")


def test_bad_requests_fail_with_a_sentence(tiny_moe_dir):
    with pytest.raises(LowbitError, match="unknown weight format 'nvfp5'"):
        load_model(tiny_moe_dir, quantization="nvfp5")
    with pytest.raises(LowbitError, match="--quantize-lm-head needs --quantization"):
        load_model(tiny_moe_dir, quantize_lm_head=True)


def test_missing_tensor_still_fails(tiny_moe_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    for f in tiny_moe_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    gone = [k for k in tensors if ".mlp.experts.3.up_proj" in k and "layers.1." in k]
    assert gone
    save_file({k: v for k, v in tensors.items() if k not in gone}, str(tmp_path / "model.safetensors"))
    with pytest.raises(LowbitError, match="missing tensors for: model.layers.1.mlp.experts.w13"):
        load_model(tmp_path, quantization="nvfp4")


def test_generate_flag(tiny_moe_dir, capsys):
    rc = main(["generate", str(tiny_moe_dir), "It is a truth", "--max-tokens", "4", "--ignore-eos",
               "--quantization", "nvfp4"])
    assert rc == 0
    assert "weights nvfp4 (" in capsys.readouterr().err


def test_checkpoint_is_untouched(tiny_moe_dir):
    before = json.loads((tiny_moe_dir / "config.json").read_text())
    load_model(tiny_moe_dir, quantization="int4")
    assert json.loads((tiny_moe_dir / "config.json").read_text()) == before
