"""Build a model and fill it: from an HF directory, a lowbit artifact, or seeded random weights.

The model is built with its parameters on the `meta` device (buffers such as rotary
frequencies are real), then each parameter is materialised on the device only when its
tensor arrives, so the device never holds more than the finished model plus one weight in
flight. With `quantization`, each weight the plan selects (lowbit.checkpoint.quant_plan)
is assembled on the CPU (an expert stack one layer at a time), moved to the device, encoded
there, and only its payload is kept. Third-party quantized checkpoints (DeepSeek FP8,
gpt-oss MXFP4, NVFP4, AWQ, GPTQ) arrive as QuantizedTensors and are kept as they are.

The loader knows nothing of processes. A `partition` (lowbit.distributed passes one for
this rank of a tensor / expert parallel world) cuts the model built on the meta device
before any weight is read, and filters the checkpoint's tensor stream to match.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from lowbit.checkpoint.artifact import load_artifact
from lowbit.checkpoint.hf import CheckpointReader, read_generation_config, resolve_model_dir
from lowbit.checkpoint.quant_plan import QuantPlan, describe_weights, plan_quantization, swappable
from lowbit.checkpoint.thirdparty import assemble, detect, quantized_tensors
from lowbit.errors import LowbitError
from lowbit.formats import QuantizedTensor
from lowbit.formats.base import ACCEPTED_DTYPES
from lowbit.layers.linear import set_quantized
from lowbit.layers.loading import default_loader
from lowbit.layers.moe import SparseMoE
from lowbit.models import build_model
from lowbit.models.config import ArchConfig, load_config

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
EXPERT_STACK = re.compile(r"\.experts\.(w13|w2|b13|b2)$")  # routed expert stacks (lowbit.layers.moe)


class Partition(Protocol):
    """The part of a model this process holds (lowbit.distributed.sharding.RankPartition)."""

    def shard(self, model: nn.Module) -> nn.Module:
        """Cut `model`, built with its parameters on the meta device, to this part."""

    def stream(self, model: nn.Module, tensors: Iterable) -> Iterator:
        """The checkpoint's (name, tensor) pairs that this part loads, cut to it."""


@dataclass
class LoadStats:
    """Device bytes held by parameters and payloads: at the end, and at the worst moment."""

    device_bytes: int = 0
    peak_device_bytes: int = 0
    quantized: int = 0  # weights encoded while loading
    source_bytes: int = 0  # bytes the same weights take in the source dtype

    def add(self, n: int, transient: int = 0) -> None:
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes + n + transient)
        self.device_bytes += n


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ArchConfig
    path: Path | None
    generation_config: dict = field(default_factory=dict)
    weight_format: str = "bf16"
    plan: QuantPlan | None = None
    stats: LoadStats = field(default_factory=LoadStats)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise LowbitError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def allocate(cfg: ArchConfig, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    with default_dtype(dtype), torch.device(device):
        return build_model(cfg).eval()


@contextlib.contextmanager
def _params_on_meta():
    """Every parameter registered inside goes to the meta device (attributes kept)."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            param = meta
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def allocate_empty(cfg: ArchConfig, dtype: torch.dtype, device: str | torch.device,
                   partition: Partition | None = None) -> torch.nn.Module:
    """The model (or the `partition` of it) with parameters on `meta` and everything else
    (buffers) on `device`."""
    # built on the CPU: an untouched torch.empty costs no memory there, and no parameter
    # ever lands on the device before its tensor is read
    with _params_on_meta(), default_dtype(dtype), torch.device("cpu"):
        m = build_model(cfg).eval()
    if partition is not None:
        m = partition.shard(m)
    for mod in m.modules():
        for name, buf in mod._buffers.items():
            if buf is not None:
                mod._buffers[name] = buf.to(device)
    return m


class DeviceFiller:
    """The sink of CausalLM.load_weights: materialises dense parameters on the device,
    assembles and encodes the ones the plan quantizes, keeps third-party payloads."""

    def __init__(self, model: nn.Module, device: str | torch.device, plan: QuantPlan | None = None,
                 experts_on_host: bool = False) -> None:
        self.model, self.device, self.plan = model, torch.device(device), plan
        self.experts_on_host = experts_on_host  # expert offload: expert stacks stay in host memory
        self.targets = swappable(model)
        self.stats = LoadStats()
        self._dense: dict[str, nn.Parameter] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._pieces: dict[str, dict] = {}

    def device_of(self, pname: str) -> torch.device:
        if self.experts_on_host and EXPERT_STACK.search(pname):
            return torch.device("cpu")
        return self.device

    def dense(self, pname: str, meta: nn.Parameter) -> nn.Parameter:
        """The device parameter for `pname`, materialised on first use."""
        if pname not in self._dense:
            mod_name, _, attr = pname.rpartition(".")
            device = self.device_of(pname)
            p = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=device),
                             requires_grad=False)
            p.__dict__.update(meta.__dict__)
            setattr(self.model.get_submodule(mod_name), attr, p)
            self._dense[pname] = p
            if device == self.device:
                self.stats.add(p.numel() * p.element_size())
        return self._dense[pname]

    def swap(self, pname: str, qt: QuantizedTensor, transient: int = 0) -> None:
        """Install `qt` (moved to the device) in place of parameter `pname`."""
        if pname not in self.targets:
            raise AssertionError(f"{pname} cannot hold a QuantizedTensor")
        mod, attr = self.targets[pname]
        device = self.device_of(pname)
        qt = qt.to(device)
        set_quantized(mod, attr, qt)
        self.stats.add(qt.nbytes if device == self.device else 0, transient)

    def __call__(self, pname: str, meta: nn.Parameter, tensor, shard, name: str, complete: bool) -> None:
        loader = getattr(meta, "weight_loader", default_loader)
        fmt = self.plan.format_of(pname) if self.plan is not None else None
        if fmt is not None:
            buf = self._buffers.get(pname)
            if buf is None:
                dt = tensor.dtype if isinstance(tensor, torch.Tensor) and tensor.dtype in ACCEPTED_DTYPES \
                    else torch.bfloat16
                buf = self._buffers[pname] = torch.empty(meta.shape, dtype=dt)
            if isinstance(tensor, QuantizedTensor) and shard is None:
                buf.copy_(_whole(tensor, tuple(meta.shape), name).dequantize(buf.dtype))
            else:
                loader(buf, _dense_of(tensor, buf.dtype), shard, name)
            if complete:
                self._encode(pname, self._buffers.pop(pname), fmt)
        elif isinstance(tensor, QuantizedTensor) and pname in self.targets:
            self._pieces.setdefault(pname, {})[shard] = tensor
            if complete:
                qt = assemble(self.model, pname, tuple(meta.shape), self._pieces.pop(pname), name)
                self.swap(pname, qt)
        else:
            p = self.dense(pname, meta)
            if isinstance(tensor, QuantizedTensor) and shard is None:
                p.data.copy_(_whole(tensor, tuple(meta.shape), name).dequantize(p.dtype))
            else:
                loader(p, _dense_of(tensor, p.dtype), shard, name)

    def _encode(self, pname: str, w: torch.Tensor, fmt) -> None:
        dev = w.to(self.device)  # the one dense weight on the device at a time
        qt = fmt.quantize(dev)
        self.stats.quantized += 1
        self.stats.source_bytes += w.numel() * w.element_size()
        self.swap(pname, qt, transient=dev.numel() * dev.element_size())


def _whole(qt: QuantizedTensor, shape: tuple[int, ...], name: str) -> QuantizedTensor:
    """A QuantizedTensor that fills a parameter alone is already in lowbit's layout."""
    if qt.shape != shape:
        raise LowbitError(f"tensor {name!r} is {list(qt.shape)} once unpacked but the model expects "
                          f"{list(shape)}; the checkpoint does not match config.json")
    return qt


def _dense_of(tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(tensor, QuantizedTensor):
        return tensor.dequantize(dtype)
    return tensor.to(dtype)


def random_init_(model: torch.nn.Module, seed: int = 0) -> None:
    """Seeded weights that keep activations finite at any depth: matrices ~ N(0, 1/fan_in)/2,
    norms 1, biases and router score biases 0."""
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    for name, p in model.named_parameters():
        _random_(name, p, g)


def _random_(name: str, p: torch.Tensor, g: torch.Generator) -> None:
    if p.dim() >= 2:
        p.data.normal_(0.0, 0.5 / math.sqrt(p.shape[-1]), generator=g)
    elif name.endswith("norm.weight") or "layernorm" in name or name.endswith("norm"):
        p.data.fill_(1.0)
    else:
        p.data.zero_()


def zipf_router_(model: nn.Module, s: float, seed: int = 0) -> list[torch.Tensor]:
    """Bias every MoE router of a random-weight model toward Zipf(s) expert popularity.

    Each layer ranks its experts by a seeded permutation (rank r = 1..E) and gets a gate bias
    b_e = -c * s * ln(r_e). Were the logits Gumbel noise, c = 1 would make the top-k choice
    a draw of p_e ~ r_e^-s without replacement (the Gumbel-top-k rule), as `lowbit bench
    expert-cache --zipf s` draws its traces. A random gate's logits are close to Gaussian,
    with sigma the root mean squared gate-row norm (the router's input is RMS-normalised
    with unit norm weights, as random_init_ makes it), so c is found by bisection such that
    Gaussian logits of that sigma plus the bias send the same share of the picks to the top
    quarter of the experts as the Gumbel draw (8,192 simulated tokens each, seeded). What a
    real run routes is then measured, not assumed: `lowbit bench expert-cache --trace` fits
    the exponent of a recorded trace. Returns the per-layer rankings (expert ids, most
    popular first)."""
    if getattr(model, "_router_zipf", None) is not None:  # an engine built again on the same model
        if model._router_zipf[0] != s:
            raise LowbitError(f"the routers already carry a Zipf({model._router_zipf[0]}) bias")
        return model._router_zipf[1]
    g = torch.Generator().manual_seed(seed + 7919)
    ranks = []
    for mod in model.modules():
        if not isinstance(mod, SparseMoE):
            continue
        w = mod.gate.weight
        E, k = w.shape[0], mod.spec.top_k
        order = torch.randperm(E, generator=g)  # order[i]: the expert of rank i + 1
        rank = torch.empty(E, dtype=torch.float64)
        rank[order] = torch.arange(1, E + 1, dtype=torch.float64)
        sigma = float(w.double().pow(2).sum(-1).mean().sqrt())
        c = _gaussian_zipf_scale(E, k, s, sigma, seed)
        bias = (-c * s * rank.log()).to(w.device)
        if mod.gate.bias is None:
            mod.gate.bias = nn.Parameter(bias.to(w.dtype), requires_grad=False)
        else:
            mod.gate.bias.data += bias.to(mod.gate.bias.dtype)
        ranks.append(order)
    if not ranks:
        raise LowbitError("--router-zipf: the model has no MoE router")
    model._router_zipf = (s, ranks)
    return ranks


def _gaussian_zipf_scale(E: int, k: int, s: float, sigma: float, seed: int, tokens: int = 8192) -> float:
    """c such that top-k of (N(0, sigma^2) logits - c s ln r) puts as many picks on ranks
    1..E/4 as top-k of (Gumbel - s ln r), the Zipf(s) draw without replacement."""
    if s == 0:
        return 0.0
    g = torch.Generator().manual_seed(seed + 104729)
    logp = -s * torch.arange(1, E + 1, dtype=torch.float64).log()
    u = torch.rand(tokens, E, generator=g, dtype=torch.float64).clamp_min(1e-300)
    q = max(1, E // 4)

    def share(scores: torch.Tensor) -> float:
        return float((scores.topk(min(k, E), dim=-1).indices < q).double().mean())

    target = share(logp - (-u.log()).log())
    z = torch.randn(tokens, E, generator=g, dtype=torch.float64) * sigma
    lo, hi = 0.0, 1.0
    while share(z + hi * logp) < target and hi < 1e6:
        lo, hi = hi, hi * 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share(z + mid * logp) < target else (lo, mid)
    return (lo + hi) / 2


def _fill_random(model: nn.Module, filler: DeviceFiller, seed: int) -> None:
    """random_init_'s values, one parameter at a time; planned ones are encoded at once."""
    g = torch.Generator(device=filler.device).manual_seed(seed)
    for name, meta in list(model.named_parameters()):
        fmt = filler.plan.format_of(name) if filler.plan is not None else None
        if fmt is None:
            p = filler.dense(name, meta)
            if p.device == filler.device:
                _random_(name, p, g)
            else:  # an expert stack kept in host memory: the same values, drawn on the device
                w = torch.empty(meta.shape, dtype=meta.dtype, device=filler.device)
                _random_(name, w, g)
                p.data.copy_(w)
            continue
        w = torch.empty(meta.shape, dtype=meta.dtype, device=filler.device)
        _random_(name, w, g)
        filler.stats.quantized += 1
        filler.stats.source_bytes += w.numel() * w.element_size()
        filler.swap(name, fmt.quantize(w), transient=w.numel() * w.element_size())


def load_model(model: str | Path, *, dtype: str | torch.dtype = "bfloat16", device: str = "cpu",
               random_weights: bool = False, config: str | Path | None = None,
               seed: int = 0, quantization: str | None = None,
               quantize_lm_head: bool = False, partition: Partition | None = None,
               experts_on_host: bool = False) -> LoadedModel:
    """`model` is a built-in name, an HF directory or a lowbit artifact; with random_weights,
    `config` (a config.json) alone decides the shape and no checkpoint is read.
    `quantization` (a format name) encodes every eligible weight while loading.
    `partition`: load only that part of the model (see the module docstring).
    `experts_on_host`: routed expert stacks go to host memory, never to `device` (expert
    offload: lowbit.engine.expert_cache takes them from there)."""
    dt = parse_dtype(dtype)
    if random_weights:
        if config is None:
            raise LowbitError("--random-weights needs --config FILE (a model's config.json)")
        cfg = load_config(config)
        m = allocate_empty(cfg, dt, device, partition)
        filler = DeviceFiller(m, device, _plan(m, quantization, quantize_lm_head), experts_on_host)
        _fill_random(m, filler, seed)
        return _loaded(m, cfg, None, {}, f"{SHORT[dt]} (random)", filler)
    path = resolve_model_dir(model)
    cfg = load_config(path)
    m = allocate_empty(cfg, dt, device, partition)
    if (path / "lowbit.json").exists():
        if quantization:
            raise LowbitError(f"{path} is a lowbit artifact, already quantized: load it as it is, "
                              "or quantize its bf16 source instead")
        if partition is not None:
            raise LowbitError("lowbit artifacts do not load sharded yet; run them on one GPU, or load the HF checkpoint")
        filler = DeviceFiller(m, device, experts_on_host=experts_on_host)
        load_artifact(path, m, filler)
        return _loaded(m, cfg, path, read_generation_config(path), SHORT[dt], filler)
    reader = CheckpointReader(path)
    filler = DeviceFiller(m, device, _plan(m, quantization, quantize_lm_head), experts_on_host)
    tensors = _checkpoint_tensors(reader, cfg, path)
    m.load_weights(tensors if partition is None else partition.stream(m, tensors), sink=filler)
    return _loaded(m, cfg, path, read_generation_config(path), reader.storage_format(), filler)


def _checkpoint_tensors(reader: CheckpointReader, cfg: ArchConfig, path: Path) -> Iterator:
    layout = detect(cfg.quantization_config)
    stream = reader.tensors(desc=f"loading {path.name}")
    return stream if layout is None else quantized_tensors(reader, layout, stream)


def _plan(m: nn.Module, quantization: str | None, quantize_lm_head: bool) -> QuantPlan | None:
    if quantize_lm_head and not quantization:
        raise LowbitError("--quantize-lm-head needs --quantization FORMAT")
    return plan_quantization(m, quantization, quantize_lm_head) if quantization else None


def _loaded(m: nn.Module, cfg: ArchConfig, path: Path | None, gen: dict, dense_format: str,
            filler: DeviceFiller) -> LoadedModel:
    fmt = describe_weights(m) or dense_format
    return LoadedModel(m, cfg, path, gen, fmt, filler.plan, filler.stats)
