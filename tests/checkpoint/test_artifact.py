import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit.checkpoint.artifact import parse_size
from lowbit.checkpoint.loader import load_model
from lowbit.cli import main
from lowbit.engine.batch import ForwardBatch
from lowbit.errors import LowbitError
from lowbit.quantize.export import quantize_model, summary_table

IDS = torch.tensor([5, 17, 40, 3, 99, 120, 7, 64, 31, 200, 11, 2])


def logits(loaded):
    batch = ForwardBatch.build([len(IDS)], [0], None, None, "cpu")
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(IDS, batch))


@pytest.fixture(scope="module")
def artifact(tiny_moe_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tiny-nvfp4"
    manifest = quantize_model(str(tiny_moe_dir), "nvfp4", out, max_shard_size="20KB", device="cpu",
                              command="lowbit quantize tiny --format nvfp4")
    return out, manifest


@pytest.fixture
def copy(artifact, tmp_path):
    dst = tmp_path / "a"
    shutil.copytree(artifact[0], dst)
    return dst


def edit_manifest(path, fn) -> None:
    m = json.loads((path / "lowbit.json").read_text())
    fn(m)
    (path / "lowbit.json").write_text(json.dumps(m))


def test_round_trip_equals_quantize_on_load(tiny_moe_dir, artifact):
    out, _ = artifact
    a = load_model(out, dtype="float32")
    b = load_model(tiny_moe_dir, dtype="float32", quantization="nvfp4")
    assert torch.equal(logits(a), logits(b))
    assert a.weight_format == b.weight_format and a.weight_format.startswith("nvfp4 (")


def test_directory_and_manifest(tiny_moe_dir, artifact):
    out, m = artifact
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and set(shards) == set(m["shards"])
    for name, info in m["shards"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == info["sha256"]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    w13 = m["tensors"]["model.layers.0.mlp.experts.w13"]
    assert w13["format"] == "nvfp4" and w13["shape"] == [4, 32, 32] and w13["dtype"] == "bfloat16"
    assert set(w13["payload"].values()) == {f"model.layers.0.mlp.experts.w13.{k}"
                                            for k in ("codes", "scales", "global_scale")}
    assert all(k in index for k in w13["payload"].values())
    assert m["tensors"]["model.embed_tokens.weight"]["format"] == "dense"
    assert m["dense"]["model.layers.1.mlp.gate.weight"].startswith("router gate")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "lowbit"
    assert cfg["quantization_config"]["format"] == "nvfp4"
    assert (out / "tokenizer.json").read_bytes() == (tiny_moe_dir / "tokenizer.json").read_bytes()
    prov = m["provenance"]
    assert prov["source_digest"].startswith("sha256:") and prov["lowbit_version"]
    assert prov["command"].startswith("lowbit quantize") and prov["date"][:2] == "20"
    t = m["totals"]
    assert t["bytes_after"] < t["bytes_before"] and 4.5 <= t["bits_per_weight"] < 4.6
    assert "bits per weight" in summary_table(m)


def test_flipped_byte_fails_the_digest(copy):
    shard = sorted(copy.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01  # inside the tensor data, after the header
    shard.write_bytes(bytes(data))
    with pytest.raises(LowbitError, match=f"{shard.name} fails its sha256 check"):
        load_model(copy)


def test_missing_tensor_is_named(copy):
    m = json.loads((copy / "lowbit.json").read_text())
    key = "model.layers.1.mlp.experts.w2.scales"
    shard = copy / json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(shard)
    del tensors[key]
    save_file(tensors, str(shard))
    m["shards"][shard.name]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (copy / "lowbit.json").write_text(json.dumps(m))
    with pytest.raises(LowbitError, match=f"{key}.*model.layers.1.mlp.experts.w2"):
        load_model(copy)


def test_unknown_format_is_named(copy):
    edit_manifest(copy, lambda m: m["tensors"]["model.layers.0.self_attn.q_proj.weight"].update(format="nvfp9"))
    with pytest.raises(LowbitError, match="q_proj.weight' has format 'nvfp9', unknown"):
        load_model(copy)


def test_wrong_shape_is_named(copy):
    edit_manifest(copy, lambda m: m["tensors"]["model.layers.0.mlp.experts.w2"].update(shape=[4, 32, 32]))
    with pytest.raises(LowbitError, match="experts.w2' has shape"):
        load_model(copy)


def test_missing_manifest_entry_and_extra_shard(copy, artifact):
    edit_manifest(copy, lambda m: m["tensors"].pop("model.norm.weight"))
    with pytest.raises(LowbitError, match="no tensor for 'model.norm.weight'"):
        load_model(copy)
    shutil.copy(artifact[0] / "lowbit.json", copy / "lowbit.json")
    save_file({"x": torch.zeros(2)}, str(copy / "stray.safetensors"))
    with pytest.raises(LowbitError, match="stray.safetensors"):
        load_model(copy)


def test_refuses_quantizing_an_artifact_again(artifact):
    with pytest.raises(LowbitError, match="already quantized"):
        load_model(artifact[0], quantization="nvfp4")


def test_cli_quantize_info_generate(tiny_moe_dir, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(tiny_moe_dir), "--format", "int4", "--out", str(out), "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "tensors quantized" in text and "bytes after" in text and "time" in text
    assert main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    assert "bytes int4" in info and "bytes bfloat16" in info
    assert main(["generate", str(out), "It is a truth", "--max-tokens", "3", "--ignore-eos"]) == 0
    assert "weights int4 (" in capsys.readouterr().err
    assert main(["quantize", str(tiny_moe_dir), "--format", "int4", "--out", str(out)]) == 2
    assert "already holds weights" in capsys.readouterr().err


def test_parse_size():
    assert parse_size("2GB") == 2 << 30 and parse_size("500MB") == 500 << 20 and parse_size("4096") == 4096
    with pytest.raises(LowbitError):
        parse_size("lots")
