"""lowbit artifacts: a quantized model as an HF-style directory, and its fail-closed reader.

Layout of an artifact directory:
  model-0000i-of-0000n.safetensors   payload tensors under `<parameter name>.<payload name>`
                                     (e.g. `model.layers.0.mlp.experts.w13.codes`), dense
                                     tensors under the parameter name
  model.safetensors.index.json       the HF weight map
  config.json                        the source config plus quantization_config
                                     {"quant_method": "lowbit", "format": F, ...}
  lowbit.json                        the manifest: every tensor's format, logical shape and
                                     dtype; each shard's sha256; the dense weights and why;
                                     provenance (source, its digest, version, command, date);
                                     with `quantize --bpw`, the plan under "allocation"
  tokenizer and generation files     copied from the source
Parameter names are lowbit's (expert stacks are `...experts.w13` [E, 2I, D], gate rows then
up rows), so an artifact loads without the family's checkpoint-name mapping.
Loading verifies every shard's digest first and refuses an unknown format, a missing or
extra tensor, or a wrong shape, naming the tensor or shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from lowbit.checkpoint.quant_plan import quantized_weights
from lowbit.errors import LowbitError
from lowbit.formats import FORMATS, QuantizedTensor
from lowbit.formats.hybrid import HybridTensor

MANIFEST = "lowbit.json"
INDEX = "model.safetensors.index.json"
ARTIFACT_VERSION = 1
DENSE = "dense"
HYBRID = "hybrid"  # an expert stack in two formats: entry "parts" {part: format, shape, payload, experts}
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".gguf")
SKIP_FILES = ("config.json", INDEX, MANIFEST, "hf_quant_config.json")


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def source_digest(path: Path) -> str:
    """sha256 over the sorted (file name, sha256) list of a directory's safetensors."""
    lines = "".join(f"{f.name} {sha256_file(f)}\n" for f in sorted(path.glob("*.safetensors")))
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def parse_size(text: str) -> int:
    """"2GB", "500MB", "1.5GiB", "4096" -> bytes."""
    t = str(text).strip().upper().replace("IB", "B")
    for unit, mult in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1)):
        if t.endswith(unit):
            t, scale = t[: -len(unit)], mult
            break
    else:
        scale = 1
    try:
        n = int(float(t) * scale)
    except ValueError:
        raise LowbitError(f"size {text!r} is not a size; write e.g. 2GB or 500MB") from None
    if n <= 0:
        raise LowbitError(f"size {text!r} must be positive")
    return n


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# -- writing -------------------------------------------------------------------------
def artifact_entries(model: nn.Module, source_dtype: torch.dtype) -> tuple[dict, list[tuple[str, object]]]:
    """(manifest tensor entries, [(safetensors key, tensor or (QuantizedTensor, payload key))])."""
    entries: dict[str, dict] = {}
    keys: list[tuple[str, object]] = []
    qts = quantized_weights(model)
    for pname, p in model.named_parameters():
        entries[pname] = {"format": DENSE, "shape": list(p.shape), "dtype": _dtype_name(p.dtype)}
        keys.append((pname, p))
    for pname, qt in qts.items():
        payload = {k: f"{pname}.{k}" for k in qt.payload}
        entries[pname] = {"format": qt.format.name, "shape": list(qt.shape),
                          "dtype": _dtype_name(source_dtype),
                          "bits_per_weight": round(qt.bits_per_weight, 6), "payload": payload}
        keys.extend((key, (qt, k)) for k, key in payload.items())
    for pname, ht in _hybrid_weights(model).items():
        parts = {}
        for part, qt in ht.parts.items():
            payload = {k: f"{pname}.{part}.{k}" for k in qt.payload}
            parts[part] = {"format": qt.format.name, "shape": list(qt.shape), "payload": payload,
                           "experts": ht.members[part]}
            keys.extend((key, (qt, k)) for k, key in payload.items())
        entries[pname] = {"format": HYBRID, "shape": list(ht.shape), "dtype": _dtype_name(source_dtype),
                          "bits_per_weight": round(ht.bits_per_weight, 6), "parts": parts}
    return dict(sorted(entries.items())), sorted(keys, key=lambda kv: kv[0])


def _hybrid_weights(model: nn.Module) -> dict:
    """Expert stacks held by parts in two formats (lowbit.formats.hybrid.HybridTensor)."""
    return {f"{name}.{attr}" if name else attr: v for name, mod in model.named_modules()
            for attr, v in vars(mod).items() if isinstance(v, HybridTensor)}


def _load_hybrid(pname: str, entry: dict, read):
    """A HybridTensor from its manifest entry (parts: format, shape, payload keys, experts)."""
    parts, members = {}, {}
    for part, p in dict(entry.get("parts", {})).items():
        fmt = FORMATS.get(p.get("format"))
        if fmt is None:
            raise LowbitError(f"artifact tensor {pname!r} part {part} has format {p.get('format')!r}, "
                              "unknown to this lowbit; upgrade lowbit or re-export")
        payload = {k: read(key, pname) for k, key in dict(p.get("payload", {})).items()}
        parts[part] = QuantizedTensor(fmt, tuple(p["shape"]), payload)
        members[part] = list(p.get("experts", []))
    return HybridTensor(tuple(entry["shape"]), parts, members)


def _tensor(item) -> torch.Tensor:
    return item[0].payload[item[1]] if isinstance(item, tuple) else item.detach()


def _nbytes(item) -> int:
    t = _tensor(item)
    return t.numel() * t.element_size()


def write_shards(out: Path, keys: list[tuple[str, object]], max_shard_bytes: int) -> dict[str, dict]:
    """Pack tensors into shards of at most max_shard_bytes (a bigger tensor gets its own)."""
    groups: list[list[tuple[str, object]]] = [[]]
    size = 0
    for key, item in keys:
        n = _nbytes(item)
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((key, item))
        size += n
    shards, weight_map = {}, {}
    bar = tqdm(total=len(keys), desc="writing", unit="tensor", delay=1.0, leave=False)
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: _tensor(item).to("cpu").contiguous() for k, item in group}, str(out / fname),
                  metadata={"format": "pt"})
        shards[fname] = {"sha256": sha256_file(out / fname), "bytes": (out / fname).stat().st_size}
        weight_map.update({k: fname for k, _ in group})
        bar.update(len(group))
    bar.close()
    total = sum(_nbytes(item) for _, item in keys)
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return shards


def copy_side_files(source: Path, out: Path) -> list[str]:
    """Tokenizer, generation config and other non-weight files of the source directory."""
    copied = []
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name not in SKIP_FILES and not f.name.endswith(WEIGHT_FILES):
            shutil.copy2(f, out / f.name)
            copied.append(f.name)
    return copied


def write_artifact(model: nn.Module, out: Path, *, source: Path, raw_config: dict, fmt: str,
                   dense_reasons: dict[str, str], provenance: dict, source_dtype: torch.dtype,
                   max_shard_bytes: int, extra: dict | None = None) -> dict:
    """Write the artifact directory; return its manifest (with `extra`'s keys added)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LowbitError(f"--out {out}: cannot create the directory ({e.strerror})") from None
    if any(out.glob("*.safetensors")) or (out / MANIFEST).exists():
        raise LowbitError(f"{out} already holds weights; choose an empty --out directory")
    entries, keys = artifact_entries(model, source_dtype)
    shards = write_shards(out, keys, max_shard_bytes)
    qts = quantized_weights(model)
    q_weights = sum(math.prod(q.shape) for q in qts.values())
    q_bytes = sum(q.nbytes for q in qts.values())
    size = torch.empty((), dtype=source_dtype).element_size()
    totals = {
        "quantized_tensors": len(qts),
        "dense_tensors": len(entries) - len(qts),
        "bytes_before": q_weights * size + sum(p.numel() * p.element_size() for p in model.parameters()),
        "bytes_after": sum(s["bytes"] for s in shards.values()),
        "bits_per_weight": round(q_bytes * 8 / q_weights, 6) if q_weights else None,
    }
    manifest = {
        "lowbit_artifact": ARTIFACT_VERSION,
        "format": fmt,
        "tensors": entries,
        "shards": shards,
        "dense": {k: v for k, v in sorted(dense_reasons.items()) if k in entries},
        "totals": totals,
        "provenance": provenance,
        **(extra or {}),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    config = dict(raw_config)
    config["quantization_config"] = {"quant_method": "lowbit", "format": fmt,
                                     "bits_per_weight": totals["bits_per_weight"],
                                     "manifest": MANIFEST}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    copy_side_files(source, out)
    return manifest


# -- reading -------------------------------------------------------------------------
def read_manifest(path: Path) -> dict:
    f = path / MANIFEST
    try:
        manifest = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LowbitError(f"{f} is unreadable ({e}); re-export the artifact") from None
    version = manifest.get("lowbit_artifact")
    if version != ARTIFACT_VERSION:
        raise LowbitError(f"{f} is artifact version {version!r}; this lowbit reads version "
                          f"{ARTIFACT_VERSION}: upgrade lowbit or re-export")
    for key in ("tensors", "shards"):
        if not isinstance(manifest.get(key), dict):
            raise LowbitError(f"{f} has no {key!r} table; re-export the artifact")
    return manifest


def verify_shards(path: Path, manifest: dict) -> None:
    on_disk = {f.name for f in path.glob("*.safetensors")}
    for fname, info in manifest["shards"].items():
        f = path / fname
        if not f.exists():
            raise LowbitError(f"artifact shard {fname} is missing from {path}; copy the whole directory")
        got = sha256_file(f)
        if got != info.get("sha256"):
            raise LowbitError(
                f"artifact shard {fname} fails its sha256 check (lowbit.json says "
                f"{str(info.get('sha256'))[:16]}..., the file is {got[:16]}...): the file is "
                "corrupt or was modified; copy it again or re-export the artifact"
            )
    extra = sorted(on_disk - set(manifest["shards"]))
    if extra:
        raise LowbitError(f"{path} holds shards lowbit.json does not list: {', '.join(extra)}; "
                          "remove them or re-export the artifact")


def load_artifact(path: Path, model: nn.Module, filler) -> dict:
    """Fill a meta-device model from the artifact at `path` through `filler` (a
    lowbit.checkpoint.loader.DeviceFiller). Returns the manifest."""
    manifest = read_manifest(path)
    verify_shards(path, manifest)
    entries: dict[str, dict] = manifest["tensors"]
    for mod in getattr(model, "optional_modules", ()):
        if getattr(model, mod, None) is not None and not any(n.startswith(f"{mod}.") for n in entries):
            setattr(model, mod, None)
    where = _key_locations(path, manifest)
    used: set[str] = set()
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(path / f), "pt")) for f in manifest["shards"]}

        def read(key: str, pname: str) -> torch.Tensor:
            if key not in where:
                raise LowbitError(f"artifact tensor {key!r} (of {pname}) is in no shard; the "
                                  "artifact is incomplete: re-export it")
            used.add(key)
            return handles[where[key]].get_tensor(key)

        params = dict(model.named_parameters())
        bar = tqdm(total=len(params), desc=f"loading {path.name}", unit="tensor", delay=1.0, leave=False)
        for pname, meta in params.items():
            _load_one(pname, meta, entries, read, filler)
            bar.update()
        bar.close()
    extra = sorted(set(entries) - set(params))
    if extra:
        raise LowbitError(f"artifact tensor {extra[0]!r} has no place in the model"
                          f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}; "
                          "the artifact does not match its config.json")
    unused = sorted(set(where) - used)
    if unused:
        raise LowbitError(f"artifact shards hold {unused[0]!r}, which lowbit.json does not list; "
                          "the artifact is inconsistent: re-export it")
    return manifest


def _key_locations(path: Path, manifest: dict) -> dict[str, str]:
    where: dict[str, str] = {}
    for fname in manifest["shards"]:
        with safe_open(str(path / fname), "pt") as h:
            for k in h.keys():
                where[k] = fname
    return where


def _load_one(pname: str, meta: nn.Parameter, entries: dict, read, filler) -> None:
    entry = entries.get(pname)
    if entry is None:
        raise LowbitError(f"artifact has no tensor for {pname!r}; it is incomplete or made for "
                          "another model: re-export it")
    if tuple(entry.get("shape", ())) != tuple(meta.shape):
        raise LowbitError(f"artifact tensor {pname!r} has shape {entry.get('shape')} but the model "
                          f"expects {list(meta.shape)}; the artifact does not match its config.json")
    fmt_name = entry.get("format")
    if fmt_name == DENSE:
        t = read(pname, pname)
        if tuple(t.shape) != tuple(meta.shape):
            raise LowbitError(f"artifact tensor {pname!r} is {list(t.shape)} in its shard but "
                              f"lowbit.json says {entry['shape']}; re-export the artifact")
        filler.dense(pname, meta).data.copy_(t)
        return
    if fmt_name == HYBRID and pname in filler.targets:
        try:
            ht = _load_hybrid(pname, entry, read)
        except (LowbitError, KeyError) as e:
            raise LowbitError(f"artifact tensor {pname!r}: {e}; re-export the artifact") from None
        filler.swap(pname, ht)
        return
    fmt = FORMATS.get(fmt_name)
    if fmt is None:
        raise LowbitError(f"artifact tensor {pname!r} has format {fmt_name!r}, unknown to this "
                          f"lowbit (knows {', '.join(FORMATS)}); upgrade lowbit or re-export")
    if pname not in filler.targets:
        raise LowbitError(f"artifact holds {pname!r} in {fmt_name}, but lowbit keeps that weight "
                          "dense; re-export the artifact with this lowbit")
    payload = {k: read(key, pname) for k, key in dict(entry.get("payload", {})).items()}
    try:
        qt = QuantizedTensor(fmt, tuple(entry["shape"]), payload)
    except LowbitError as e:
        raise LowbitError(f"artifact tensor {pname!r}: {e}") from None
    filler.swap(pname, qt)


def bytes_by_format(path: Path) -> dict[str, tuple[int, int]]:
    """An artifact's format (dense ones by dtype) -> (weights, bytes), from shard headers."""
    manifest = read_manifest(path)
    sizes: dict[str, int] = {}
    for fname in manifest["shards"]:
        with safe_open(str(path / fname), "pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                n = math.prod(sl.get_shape())
                sizes[k] = n * _DTYPE_BYTES.get(sl.get_dtype(), 4)
    out: dict[str, list[int]] = {}
    for pname, e in manifest["tensors"].items():
        name = e["dtype"] if e["format"] == DENSE else e["format"]
        keys = [pname] if e["format"] == DENSE else list(e.get("payload", {}).values())
        acc = out.setdefault(name, [0, 0])
        acc[0] += math.prod(e["shape"])
        acc[1] += sum(sizes.get(k, 0) for k in keys)
    return {k: (v[0], v[1]) for k, v in out.items()}


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "F8_E4M3": 1,
                "F8_E5M2": 1, "I32": 4, "I64": 8, "I16": 2, "BOOL": 1}
