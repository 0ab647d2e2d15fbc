"""Third-party quantized checkpoints: detect the layout from config.json's
`quantization_config`, group each weight's component tensors into a QuantizedTensor
(lowbit.formats.thirdparty does the tensor transforms), and stack per-expert pieces.

Layouts (component names are suffixes of the weight's base name):
  deepseek-fp8      quant_method "fp8", weight_block_size [128, 128]:
                    .weight float8_e4m3fn + .weight_scale_inv                -> fp8-block
  gpt-oss-mxfp4     quant_method "mxfp4": experts' gate_up_proj / down_proj as
                    _blocks + _scales (gate/up rows interleaved)              -> mxfp4
  ct-nvfp4          quant_method "compressed-tensors", format "nvfp4-pack-quantized":
                    .weight_packed + .weight_scale + .weight_global_scale
                    (+ .input_global_scale, for activations, dropped)          -> nvfp4
  modelopt-nvfp4    quant_method "modelopt", quant_algo "NVFP4": .weight uint8 +
                    .weight_scale + .weight_scale_2 (+ .input_scale, dropped)  -> nvfp4
  awq               quant_method "awq", version "gemm": .qweight + .qzeros + .scales -> int4
  gptq              quant_method "gptq": .qweight + .qzeros + .scales (+ .g_idx) -> int4
Every QuantizedTensor yielded is in lowbit's layout: [.., N, K], rows are outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lowbit.checkpoint.hf import CheckpointReader
from lowbit.errors import LowbitError
from lowbit.formats import QuantizedTensor, get_format
from lowbit.formats import thirdparty as tp


@dataclass(frozen=True)
class Layout:
    name: str
    needs: tuple[str, ...]  # component suffixes, the first one marks the weight
    optional: tuple[str, ...]
    out: str  # suffix of the dense weight name the QuantizedTensor stands for
    build: Callable[[dict[str, Tensor], str], QuantizedTensor]
    anchor_dtypes: tuple[torch.dtype, ...] = ()  # needs[0] counts only with these dtypes


def _fp8(parts: dict[str, Tensor], base: str) -> QuantizedTensor:
    return tp.from_deepseek_fp8(parts[".weight"], parts[".weight_scale_inv"])


def _mxfp4(parts: dict[str, Tensor], base: str) -> QuantizedTensor:
    qt = tp.from_gpt_oss_mxfp4(parts["_blocks"], parts["_scales"])
    if base.endswith("gate_up_proj"):  # rows 2i are gate, 2i+1 up -> gate rows then up rows
        n = qt.shape[-2]
        order = torch.cat((torch.arange(0, n, 2), torch.arange(1, n, 2)))
        qt = QuantizedTensor(qt.format, qt.shape, {k: v[..., order, :] for k, v in qt.payload.items()})
    return qt


def _ct_nvfp4(parts: dict[str, Tensor], base: str) -> QuantizedTensor:
    return tp.from_compressed_tensors_nvfp4(
        parts[".weight_packed"], parts[".weight_scale"], parts[".weight_global_scale"])


def _modelopt_nvfp4(parts: dict[str, Tensor], base: str) -> QuantizedTensor:
    packed, scale = parts[".weight"], parts[".weight_scale"]
    *lead, n, half = packed.shape
    g = parts[".weight_scale_2"].float().reshape(lead)  # a multiplier here: w = e2m1 * s * g
    return QuantizedTensor(get_format("nvfp4"), (*lead, n, 2 * half),
                           {"codes": packed, "scales": scale, "global_scale": g})


def _awq(parts: dict[str, Tensor], base: str) -> QuantizedTensor:
    return tp.from_awq(parts[".qweight"], parts[".qzeros"], parts[".scales"])


def _gptq(zero_offset: int) -> Callable[[dict[str, Tensor], str], QuantizedTensor]:
    def build(parts: dict[str, Tensor], base: str) -> QuantizedTensor:
        return tp.from_gptq(parts[".qweight"], parts[".qzeros"], parts[".scales"],
                            parts.get(".g_idx"), zero_offset)
    return build


def detect(qc: dict | None) -> Layout | None:
    """The layout config.json's quantization_config names; None for a dense checkpoint."""
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "lowbit":
        raise LowbitError("config.json says this is a lowbit artifact (quant_method 'lowbit') but "
                          "lowbit.json, its manifest, is missing; the artifact is incomplete: "
                          "write it again with lowbit quantize")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if list(block or []) != [128, 128]:
            raise LowbitError(
                f"FP8 checkpoint with weight_block_size {block}: lowbit reads the DeepSeek-V3 "
                "layout (128x128 blocks with weight_scale_inv); per-tensor FP8 is not supported"
            )
        return Layout("deepseek-fp8", (".weight_scale_inv", ".weight"), (), ".weight", _fp8)
    if method == "mxfp4":
        return Layout("gpt-oss-mxfp4", ("_blocks", "_scales"), (), "", _mxfp4)
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt != "nvfp4-pack-quantized":
            raise LowbitError(
                f"compressed-tensors format {fmt!r} is not supported; lowbit reads "
                "nvfp4-pack-quantized (or use an AWQ / GPTQ / FP8 / MXFP4 checkpoint)"
            )
        return Layout("ct-nvfp4", (".weight_packed", ".weight_scale", ".weight_global_scale"),
                      (".input_global_scale",), ".weight", _ct_nvfp4)
    if method == "modelopt":
        if str(qc.get("quant_algo", "")).upper() != "NVFP4":
            raise LowbitError(f"ModelOpt quant_algo {qc.get('quant_algo')!r} is not supported; "
                              "lowbit reads ModelOpt NVFP4 checkpoints")
        return Layout("modelopt-nvfp4", (".weight_scale_2", ".weight", ".weight_scale"),
                      (".input_scale",), ".weight", _modelopt_nvfp4)
    if method in ("awq", "gptq"):
        if int(qc.get("bits", 4)) != 4:
            raise LowbitError(f"{method} with bits={qc.get('bits')}: lowbit reads 4-bit {method} only")
        if method == "awq":
            if str(qc.get("version", "gemm")).lower() != "gemm":
                raise LowbitError(f"AWQ version {qc.get('version')!r} is not supported; use the GEMM packing")
            return Layout("awq", (".qweight", ".qzeros", ".scales"), (), ".weight", _awq)
        offset = 0 if str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2" else 1
        return Layout("gptq", (".qweight", ".qzeros", ".scales"), (".g_idx",), ".weight", _gptq(offset))
    raise LowbitError(
        f"quantization_config.quant_method {method!r} is not supported; lowbit reads fp8 "
        "(DeepSeek blocks), mxfp4 (gpt-oss), compressed-tensors / modelopt NVFP4, awq, gptq and "
        "its own artifacts"
    )


def _component(name: str, layout: Layout, reader: CheckpointReader) -> tuple[str, str] | None:
    """(base, suffix) when `name` is a component of a quantized weight of this layout."""
    for suffix in layout.needs + layout.optional:
        if name.endswith(suffix):
            base = name[: len(name) - len(suffix)]
            if f"{base}{layout.needs[0]}" in reader:
                return base, suffix
    return None


def quantized_tensors(reader: CheckpointReader, layout: Layout,
                      stream: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors with each quantized weight's components replaced by one
    (dense weight name, QuantizedTensor); other tensors pass through."""
    done: set[str] = set()
    for name, t in stream:
        hit = _component(name, layout, reader)
        if hit is None:
            yield name, t
            continue
        base, _ = hit
        if base in done:
            continue
        done.add(base)
        parts = {}
        for suffix in layout.needs + layout.optional:
            key = f"{base}{suffix}"
            if key == name:
                parts[suffix] = t
            elif key in reader:
                parts[suffix] = reader.get(key)
            elif suffix in layout.needs:
                raise LowbitError(f"{layout.name} checkpoint has {name!r} but not {key!r}; "
                                  "the checkpoint is incomplete")
        try:
            qt = layout.build(parts, base)
        except LowbitError as e:
            raise LowbitError(f"tensor {base}{layout.out!r} ({layout.name}): {e}") from None
        yield f"{base}{layout.out}", qt


# -- assembling expert stacks ---------------------------------------------------------
def concat_rows(parts: list[QuantizedTensor], what: str) -> QuantizedTensor:
    """Stack [N_i, K] weights of one format into [sum N_i, K], payload by payload."""
    fmt = parts[0].format
    if any(p.format is not fmt or p.shape[:-2] != parts[0].shape[:-2] or p.shape[-1] != parts[0].shape[-1]
           for p in parts):
        raise LowbitError(f"{what}: its pieces differ in format or shape; the checkpoint is inconsistent")
    if fmt.name == "fp8-block" and any(p.shape[-2] % 128 for p in parts[:-1]):
        raise LowbitError(f"{what}: fp8-block pieces of {parts[0].shape[-2]} rows (not a multiple of "
                          "128) cannot share a stack; such a checkpoint is not supported")
    shape = (*parts[0].shape[:-2], sum(p.shape[-2] for p in parts), parts[0].shape[-1])
    spec = fmt.payload_spec(shape)
    payload = {}
    for key, (want, _) in spec.items():
        ts = [p.payload[key] for p in parts]
        if all(t.shape == ts[0].shape for t in ts) and tuple(ts[0].shape) == tuple(want):
            if not all(torch.equal(t, ts[0]) for t in ts):  # a per-matrix value, e.g. a global scale
                raise LowbitError(
                    f"{what}: the pieces have different {fmt.name} {key!r} values but lowbit keeps "
                    "one per stacked matrix (gate and up must share it); re-export with fused scales"
                )
            payload[key] = ts[0]
            continue
        axis = next(a for a in range(len(want)) if want[a] != ts[0].shape[a])
        payload[key] = torch.cat(ts, dim=axis)
    return QuantizedTensor(fmt, shape, payload)


def stack_experts(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """E weights [N, K] -> one [E, N, K]."""
    payload = {k: torch.stack([p.payload[k] for p in parts]) for k in parts[0].payload}
    return QuantizedTensor(parts[0].format, (len(parts), *parts[0].shape), payload)


def assemble(model: nn.Module, pname: str, shape: tuple[int, ...], pieces: dict,
             name: str) -> QuantizedTensor:
    """The QuantizedTensor for parameter `pname` from its loaded pieces (keys are the
    shards of CausalLM.map_name: None for the whole weight, (e, half) for expert rows)."""
    if set(pieces) == {None}:
        qt = pieces[None]
    else:
        experts = []
        for e in range(shape[0]):
            halves = [pieces[(e, h)] for h in (0, 1)] if (e, 0) in pieces else [pieces[(e, None)]]
            experts.append(halves[0] if len(halves) == 1 else concat_rows(halves, f"{pname}[{e}]"))
        qt = stack_experts(experts)
    if qt.shape != tuple(shape):
        raise LowbitError(f"tensor {name!r} is {list(qt.shape)} once unpacked but the model expects "
                          f"{list(shape)}; the checkpoint does not match config.json")
    return qt
