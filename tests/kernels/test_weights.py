"""Kernel-side weight resolution: decode choice per table, fp8 payloads, caching, configs."""

import json

import torch

from lowbit.formats import get_format
from lowbit.formats.codes import e2m1_table
from lowbit.formats.nf import NF4_TABLE
from lowbit.formats.views import DenseWeight, Fp8View, LutWeight
from lowbit.kernels import launch
from lowbit.kernels.weights import (
    DECODE_AFFINE,
    DECODE_E2M1,
    DECODE_GATHER,
    classify_table,
    resolve,
)


def test_classify_tables():
    mode, ab = classify_table(torch.arange(16.0)[None], 4)
    assert mode == DECODE_AFFINE
    c = torch.arange(16.0)
    assert torch.equal(ab[0, 0] * (1 + c / 16) + ab[0, 1], c)
    mode, ab = classify_table(torch.stack([e2m1_table() * 3.0, e2m1_table() * 0.25]), 4)
    assert mode == DECODE_E2M1 and torch.equal(ab[:, 0], torch.tensor([3.0, 0.25]) * 2.0**14)
    assert classify_table(torch.tensor([NF4_TABLE]), 4)[0] == DECODE_GATHER


def test_resolve_real_formats():
    w = torch.randn(2, 24, 64)
    assert resolve(get_format("nvfp4").quantize(w)).decode == DECODE_E2M1
    assert resolve(get_format("int4").quantize(w)).decode == DECODE_AFFINE
    assert resolve(get_format("nf4").quantize(w)).decode == DECODE_GATHER
    fp8 = resolve(get_format("fp8-block").quantize(w))
    assert isinstance(fp8, Fp8View) and (fp8.block_rows, fp8.block_cols) == (128, 128)
    mx = resolve(get_format("mxfp8").quantize(w))
    assert isinstance(mx, Fp8View) and mx.scale_kind == "e8m0" and mx.block_cols == 32
    for name in ("fp8", "fp8-block", "mxfp8", "nvfp4", "lut3"):
        qt = get_format(name).quantize(w)
        torch.testing.assert_close(resolve(qt).dense(64), qt.dequantize(), rtol=0, atol=0)
    assert isinstance(resolve(w), DenseWeight)


def test_resolve_cache_follows_payload_changes():
    qt = get_format("int4").quantize(torch.randn(16, 64))
    first = resolve(qt)
    assert resolve(qt) is first
    qt.payload["scales"].mul_(2)  # in-place edit bumps the tensor version
    assert resolve(qt) is not first and isinstance(resolve(qt), LutWeight)


def test_resolve_takes_inference_tensors():
    """A payload made under inference mode (no version counter) resolves, and once."""
    with torch.inference_mode():
        qt = get_format("nvfp4").quantize(torch.randn(16, 64))
    assert qt.payload["codes"].is_inference()
    first = resolve(qt)
    assert resolve(qt) is first
    torch.testing.assert_close(first.dense(64), qt.dequantize(), rtol=0, atol=0)


def test_config_lookup_buckets_and_device_files(tmp_path, monkeypatch):
    (tmp_path / "default.json").write_text(json.dumps(
        {"gemv": {"default": {"1": {"BN": 1}, "16": {"BN": 16}}}}))
    (tmp_path / "my_gpu.json").write_text(json.dumps(
        {"gemv": {"lut4:64x32": {"4": {"BN": 4}}}}))
    monkeypatch.setattr(launch, "CONFIG_DIR", tmp_path)
    launch.clear_cache()
    try:
        assert launch.lookup("gemv", "lut4", 64, 32, 3, device="my gpu") == {"BN": 4}
        assert launch.lookup("gemv", "lut4", 64, 32, 9, device="my gpu") == {"BN": 4}
        assert launch.lookup("gemv", "lut3", 64, 32, 9, device="my gpu") == {"BN": 16}
        assert launch.lookup("gemv", "lut3", 64, 32, 1, device="other") == {"BN": 1}
        assert launch.lookup("gemv", "lut3", 64, 32, 99, device="other") == {"BN": 16}
        # a tuple of keys, most specific first: the first tuned entry wins, then the default
        assert launch.lookup("gemv", ("lut4-e2m1-e4m3-16", "lut4"), 64, 32, 3, device="my gpu") == {"BN": 4}
        assert launch.lookup("gemv", ("lut3-x", "lut3"), 64, 32, 3, device="my gpu") == {"BN": 16}
    finally:
        launch.clear_cache()


def test_a_device_borrows_an_aliased_file_and_an_untuned_one_warns(tmp_path, monkeypatch, caplog):
    (tmp_path / "default.json").write_text(json.dumps({"gemv": {"default": {"1": {"BN": 1}}}}))
    (tmp_path / "big_gpu.json").write_text(json.dumps(
        {"gemv": {"default": {"1": {"BN": 8}}}, "choice": {"lut4:64x32": {"1": "gemm"}}}))
    (tmp_path / "aliases.json").write_text(json.dumps({"sibling_gpu": "big_gpu", "lost_gpu": "missing"}))
    monkeypatch.setattr(launch, "CONFIG_DIR", tmp_path)
    launch.clear_cache()
    try:
        assert launch.lookup("gemv", "lut4", 64, 32, 1, device="Sibling GPU") == {"BN": 8}
        assert launch.choice("lut4", 64, 32, 1, device="Sibling GPU") == "gemm"
        assert launch.config_status("Sibling GPU") == ("launch configs: big_gpu.json (borrowed by sibling_gpu: "
                                                       "same die and SM count)")
        assert launch.config_status("Big GPU") == "launch configs: big_gpu.json"
        with caplog.at_level("WARNING", logger="lowbit"):
            assert launch.lookup("gemv", "lut4", 64, 32, 1, device="Lost GPU") == {"BN": 1}
        assert "no tuned file for lost_gpu" in caplog.text
        assert launch.config_status("Lost GPU").startswith("launch configs: NONE tuned for lost_gpu")
    finally:
        launch.clear_cache()


def test_the_shipped_aliases_point_at_shipped_files():
    for own, alias in json.loads((launch.CONFIG_DIR / "aliases.json").read_text()).items():
        assert (launch.CONFIG_DIR / f"{alias}.json").exists() and not (launch.CONFIG_DIR / f"{own}.json").exists()


def test_launch_config_keys_tell_formats_apart():
    from lowbit.kernels.dequant_gemm import fmt_key
    from tests.kernels.cases import make_weight

    keys = {case: fmt_key(make_weight(case, 8, 64)) for case in
            ("int4_g32_offsets", "nvfp4_two_tables", "mxfp4", "nf4", "nf3", "fp8_channel")}
    assert keys["nvfp4_two_tables"] == "lut4-e2m1-e4m3-16"
    assert keys["int4_g32_offsets"] == "lut4-affine-f16-32+offs"
    assert len(set(keys.values())) == len(keys), keys  # each tunes apart


def test_moe_config_keys_put_the_decode_first():
    from lowbit.kernels.moe import moe_fmt_keys
    from tests.kernels.cases import make_weight

    nv = moe_fmt_keys(make_weight("nvfp4_two_tables", 8, 64, lead=(2,)))
    i4 = moe_fmt_keys(make_weight("int4_g32_offsets", 8, 64, lead=(2,)))
    assert nv[-1] == i4[-1] == "lut4" and nv[0] != i4[0] and nv[0].startswith("lut4-e2m1")
    assert moe_fmt_keys(resolve(torch.randn(2, 8, 64).bfloat16())) == ("dense",)
