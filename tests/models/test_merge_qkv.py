"""Merged QKV at serving time: the model's logits are the same before and after
`prepare_for_serving` for plain and LUT-quantized projections (rows keep their own tables),
and the merged weight also runs through the gemv kernel (interpreter, forced route)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.checkpoint.loader import load_model  # noqa: E402
from lowbit.engine.batch import ForwardBatch  # noqa: E402
from lowbit.formats.views import LutWeight  # noqa: E402


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    batch = ForwardBatch.build([ids.numel()], [0], None)
    with torch.inference_mode():
        return model.compute_logits(model(ids, batch))


@pytest.mark.parametrize("quant", [None, "nvfp4", "int4", "fp8"])
def test_merged_qkv_gives_the_same_logits(tiny_moe_dir, quant):
    model = load_model(str(tiny_moe_dir), dtype="float32", device="cpu", quantization=quant).model
    ids = torch.tensor([3, 17, 42, 5, 99])
    before = _logits(model, ids)
    model.prepare_for_serving()
    attn = model.model.layers[0].self_attn
    if quant == "fp8":  # no LUT view: the three projections stay
        assert attn.qkv_proj is None and attn.q_proj is not None
    else:
        assert attn.qkv_proj is not None and attn.q_proj is None
    if quant in ("nvfp4", "int4"):
        w = attn.qkv_proj.weight
        assert isinstance(w, LutWeight) and w.view.table.shape[0] == 3  # q, k, v tables
        assert w.view.table_index.shape == (w.n,)
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-5, atol=1e-5)


def test_merged_quantized_qkv_through_the_gemv(tiny_moe_dir, monkeypatch):
    from lowbit.kernels import linear

    model = load_model(str(tiny_moe_dir), dtype="float32", device="cpu", quantization="nvfp4").model
    model.prepare_for_serving()
    w = model.model.layers[0].self_attn.qkv_proj.weight
    x = torch.randn(2, w.kp).bfloat16()
    ref = linear(x, w)
    monkeypatch.setenv("LOWBIT_ROUTE_LINEAR", "triton_lut_gemv")
    out = linear(x, w)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
