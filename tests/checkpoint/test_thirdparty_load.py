"""Third-party quantized checkpoints through load_model. Each test packs integer codes by
hand in the published layout (no lowbit encoder involved), writes the same weights as
plain float32 in a second checkpoint, and compares the two models' logits."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit.checkpoint.loader import load_model
from lowbit.checkpoint.quant_plan import quantized_weights
from lowbit.engine.batch import ForwardBatch
from lowbit.errors import LowbitError

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
V, D, H, HKV, DH, E, INTER = 96, 64, 4, 2, 16, 2, 128
IDS = torch.tensor([1, 50, 7, 33, 90, 12, 64, 5, 71, 28])


def qwen_config(model_type: str = "qwen3_moe") -> dict:
    return {"model_type": model_type, "architectures": ["X"], "vocab_size": V, "hidden_size": D,
            "intermediate_size": INTER, "moe_intermediate_size": INTER, "num_hidden_layers": 1,
            "num_attention_heads": H, "num_key_value_heads": HKV, "head_dim": DH,
            "num_experts": E, "num_local_experts": E, "num_experts_per_tok": 2,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "norm_topk_prob": True,
            "tie_word_embeddings": False}


def linear_shapes(mixtral: bool) -> dict[str, tuple[int, int]]:
    p = "model.layers.0."
    shapes = {f"{p}self_attn.q_proj": (H * DH, D), f"{p}self_attn.k_proj": (HKV * DH, D),
              f"{p}self_attn.v_proj": (HKV * DH, D), f"{p}self_attn.o_proj": (D, H * DH)}
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    mlp = "block_sparse_moe" if mixtral else "mlp"
    for e in range(E):
        shapes[f"{p}{mlp}.experts.{e}.{names[0]}"] = (INTER, D)
        shapes[f"{p}{mlp}.experts.{e}.{names[1]}"] = (INTER, D)
        shapes[f"{p}{mlp}.experts.{e}.{names[2]}"] = (D, INTER)
    return shapes


def dense_rest(mixtral: bool, g: torch.Generator) -> dict[str, torch.Tensor]:
    p = "model.layers.0."
    t = {"model.embed_tokens.weight": torch.randn(V, D, generator=g),
         "lm_head.weight": torch.randn(V, D, generator=g) / 8,
         "model.norm.weight": 1 + torch.rand(D, generator=g) / 4,
         f"{p}input_layernorm.weight": 1 + torch.rand(D, generator=g) / 4,
         f"{p}post_attention_layernorm.weight": 1 + torch.rand(D, generator=g) / 4,
         f"{p}{'block_sparse_moe' if mixtral else 'mlp'}.gate.weight": torch.randn(E, D, generator=g) / 8}
    if not mixtral:
        t[f"{p}self_attn.q_norm.weight"] = 1 + torch.rand(DH, generator=g) / 4
        t[f"{p}self_attn.k_norm.weight"] = 1 + torch.rand(DH, generator=g) / 4
    return t


def int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding 32 unsigned bits -> the int32 with the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def nibbles_low_first(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


# -- hand packers: (component tensors, float32 reference weight) per linear ------------
def pack_fp8(shape, g, key):
    n, k = shape
    codes = (torch.randn(n, k, generator=g) * 8).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.01 + 0.005
    ref = codes.float() * scale_inv.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return {".weight": codes, ".weight_scale_inv": scale_inv}, ref


def nvfp4_parts(shape, g, key):
    n, k = shape
    codes = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.5, 2.0])[torch.randint(0, 6, (n, k // 16), generator=g)]
    divisor = 4.0 if ".experts.1." in key else 2.0  # gate and up of one expert share it
    ref = E2M1[codes] * scale.repeat_interleave(16, 1) / divisor
    return nibbles_low_first(codes), scale.to(torch.float8_e4m3fn), divisor, ref


def pack_ct_nvfp4(shape, g, key):
    packed, scale, divisor, ref = nvfp4_parts(shape, g, key)
    return {".weight_packed": packed, ".weight_scale": scale,
            ".weight_global_scale": torch.tensor([divisor]), ".input_global_scale": torch.tensor([3.0])}, ref


def pack_modelopt_nvfp4(shape, g, key):
    packed, scale, divisor, ref = nvfp4_parts(shape, g, key)
    return {".weight": packed, ".weight_scale": scale, ".weight_scale_2": torch.tensor(1 / divisor),
            ".input_scale": torch.tensor(0.5)}, ref


def int4_parts(shape, g, group=32):
    n, k = shape
    q = torch.randint(0, 16, (k, n), generator=g)
    z = torch.randint(1, 16, (k // group, n), generator=g)
    s = (torch.rand(k // group, n, generator=g) * 0.02 + 0.01).half()
    ref = ((q - z.repeat_interleave(group, 0)) * s.float().repeat_interleave(group, 0)).T.contiguous()
    return q, z, s, ref


def pack_awq(shape, g, key):
    q, z, s, ref = int4_parts(shape, g)

    def pack(x):  # [R, N] -> int32 [R, N/8]; nibble i of column block c holds column 8c + ORDER[i]
        x = x.long().reshape(x.shape[0], -1, 8)
        return int32(sum(x[..., AWQ_ORDER[i]] << (4 * i) for i in range(8)))

    return {".qweight": pack(q), ".qzeros": pack(z), ".scales": s}, ref


def pack_gptq(shape, g, key):
    q, z, s, ref = int4_parts(shape, g)
    k, n = q.shape
    qw = q.long().reshape(k // 8, 8, n)  # nibble i of row r holds input k = 8r + i
    qweight = int32(sum(qw[:, i] << (4 * i) for i in range(8)))
    zz = (z - 1).long().reshape(z.shape[0], n // 8, 8)  # stored z - 1, nibble i of column c: n = 8c + i
    qzeros = int32(sum(zz[..., i] << (4 * i) for i in range(8)))
    return {".qweight": qweight, ".qzeros": qzeros, ".scales": s,
            ".g_idx": torch.arange(k, dtype=torch.int32) // 32}, ref


def write(path, config: dict, tensors: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


def logits(path) -> tuple[torch.Tensor, object]:
    lm = load_model(path, dtype="float32")
    with torch.inference_mode():
        out = lm.model.compute_logits(lm.model(IDS, ForwardBatch.build([len(IDS)], [0], None, None, "cpu")))
    return out, lm


LAYOUTS = {
    "deepseek-fp8": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 128]}, pack_fp8, "fp8-block", False),
    "ct-nvfp4": ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
                 pack_ct_nvfp4, "nvfp4", False),
    "modelopt-nvfp4": ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, pack_modelopt_nvfp4, "nvfp4", False),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
            pack_awq, "int4-g32", True),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False},
             pack_gptq, "int4-g32", False),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_loads_as_its_format(layout, tmp_path):
    qc, pack, fmt, mixtral = LAYOUTS[layout]
    g = torch.Generator().manual_seed(0)
    config = qwen_config("mixtral" if mixtral else "qwen3_moe")
    rest = dense_rest(mixtral, g)
    dense, quant = dict(rest), dict(rest)
    for key, shape in linear_shapes(mixtral).items():
        parts, ref = pack(shape, g, key)
        dense[f"{key}.weight"] = ref
        quant.update({f"{key}{suffix}": t for suffix, t in parts.items()})
    write(tmp_path / "dense", config, dense)
    write(tmp_path / "quant", {**config, "quantization_config": qc}, quant)
    want, _ = logits(tmp_path / "dense")
    got, lm = logits(tmp_path / "quant")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    q = quantized_weights(lm.model)
    assert {v.format.name for v in q.values()} == {fmt}
    assert "model.layers.0.mlp.experts.w13" in q and "model.layers.0.self_attn.q_proj.weight" in q
    assert lm.weight_format.startswith(fmt)


def test_gpt_oss_mxfp4_experts(tmp_path):
    from transformers import GptOssConfig, GptOssForCausalLM

    from tests.models.parity import save_tiny

    cfg = GptOssConfig(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=H, num_key_value_heads=HKV, head_dim=DH, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64,
                       experts_implementation="eager")
    save_tiny(GptOssForCausalLM, cfg, tmp_path / "dense", randomize=("bias", "sinks"))
    dense = load_file(str(tmp_path / "dense" / "model.safetensors"))
    quant = dict(dense)
    g = torch.Generator().manual_seed(1)
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        for proj, (n, k) in (("gate_up_proj", (128, D)), ("down_proj", (D, 64))):
            codes = torch.randint(0, 16, (4, n, k), generator=g)
            e8m0 = torch.randint(124, 129, (4, n, k // 32), generator=g)
            w = E2M1[codes] * torch.exp2(e8m0.float() - 127).repeat_interleave(32, -1)  # [E, out, in]
            dense[p + proj] = w.transpose(1, 2).contiguous()  # transformers keeps [E, in, out]
            del quant[p + proj]
            quant[p + proj + "_blocks"] = nibbles_low_first(codes).reshape(4, n, k // 32, 16)
            quant[p + proj + "_scales"] = e8m0.to(torch.uint8)
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    save_file(dense, str(tmp_path / "dense" / "model.safetensors"))
    write(tmp_path / "quant", {**config, "quantization_config": {"quant_method": "mxfp4"}}, quant)
    want, _ = logits(tmp_path / "dense")
    got, lm = logits(tmp_path / "quant")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert {v.format.name for v in quantized_weights(lm.model).values()} == {"mxfp4"}
    # re-encoding: the MXFP4 stacks (our layout) and the transformers stacks (interleaved,
    # transposed) hold the same values, so nvfp4 made from either is the same model
    a = load_model(tmp_path / "quant", dtype="float32", quantization="nvfp4")
    b = load_model(tmp_path / "dense", dtype="float32", quantization="nvfp4")
    qa, qb = quantized_weights(a.model), quantized_weights(b.model)
    assert set(qa) == set(qb) and "model.layers.1.mlp.experts.w13" in qa
    assert all(torch.equal(qa[k].dequantize(), qb[k].dequantize()) for k in qa)


def test_unsupported_and_incomplete_checkpoints(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = dense_rest(False, g)
    for key, shape in linear_shapes(False).items():
        parts, _ = pack_awq(shape, g, key)
        tensors.update({f"{key}{s}": t for s, t in parts.items()})
    config = qwen_config()
    write(tmp_path / "a", {**config, "quantization_config": {"quant_method": "bitsandbytes"}}, tensors)
    with pytest.raises(LowbitError, match="quant_method 'bitsandbytes' is not supported"):
        load_model(tmp_path / "a")
    del tensors["model.layers.0.self_attn.k_proj.qzeros"]
    write(tmp_path / "b", {**config, "quantization_config": {"quant_method": "awq", "group_size": 32}}, tensors)
    with pytest.raises(LowbitError, match="k_proj.qweight.*k_proj.qzeros"):
        load_model(tmp_path / "b")


def test_requantize_a_third_party_checkpoint(tmp_path):
    """fp8 blocks -> nvfp4 on load: pieces are decoded on the CPU, then encoded."""
    qc, pack, _, _ = LAYOUTS["deepseek-fp8"]
    g = torch.Generator().manual_seed(0)
    tensors = dense_rest(False, g)
    for key, shape in linear_shapes(False).items():
        parts, _ = pack(shape, g, key)
        tensors.update({f"{key}{s}": t for s, t in parts.items()})
    write(tmp_path / "q", {**qwen_config(), "quantization_config": qc}, tensors)
    lm = load_model(tmp_path / "q", dtype="float32", quantization="nvfp4")
    assert {v.format.name for v in quantized_weights(lm.model).values()} == {"nvfp4"}
