"""HF model directories: config, safetensors shards read lazily by name, generation config.

Only safetensors are read. A directory holding only pickle files (*.bin, *.pt, *.pth)
is refused: loading pickle runs arbitrary code.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from lowbit.errors import LowbitError

_PACKAGE = Path(__file__).resolve().parent.parent
# Built-in models: the demo model, and its 2-layer draft for --speculative-method draft.
BUILTIN = {"demo": _PACKAGE / "demo_model", "demo-draft": _PACKAGE / "demo_draft"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def resolve_model_dir(model: str | Path) -> Path:
    """A built-in name or a local directory -> the directory (which must hold config.json)."""
    if str(model) in BUILTIN:
        path = BUILTIN[str(model)]
        if not (path / "config.json").exists():
            raise LowbitError(f"the built-in model {model!r} is not installed at {path}")
        return path
    path = Path(model).expanduser()
    if not path.is_dir():
        raise LowbitError(
            f"model {str(model)!r} is neither a built-in name ({', '.join(BUILTIN)}) nor a local "
            "directory; lowbit loads HF model directories from disk (download them first)"
        )
    if not (path / "config.json").exists():
        raise LowbitError(f"{path} has no config.json; is it an HF model directory?")
    return path


class CheckpointReader:
    """Lazy access to every tensor of a directory's safetensors files, by name."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.files = self._find_shards()
        self._where: dict[str, Path] = {}
        for f in self.files:
            try:
                with safe_open(str(f), "pt") as h:
                    for k in h.keys():
                        self._where[k] = f
            except Exception as e:  # safetensors raises its own error types for a bad header
                raise LowbitError(f"{f} is not a readable safetensors file ({e}); re-download or "
                                  "re-export it") from None

    def _find_shards(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise LowbitError(f"{index} is malformed: {e}") from e
            files = sorted({self.path / f for f in wm.values()})
            absent = [f.name for f in files if not f.exists()]
            if absent:
                raise LowbitError(f"{index.name} names shards that are missing: {', '.join(absent)}")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if files:
            return files
        pickles = [p.name for p in self.path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise LowbitError(
                f"{self.path} holds only pickle weights ({', '.join(pickles[:3])}); lowbit reads "
                "safetensors only. Convert them once with a trusted tool (save_pretrained with "
                "safe_serialization=True)."
            )
        raise LowbitError(f"{self.path} has no *.safetensors weight files")

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise LowbitError(f"tensor {name!r} is not in the checkpoint at {self.path}")
        with safe_open(str(self._where[name]), "pt") as h:
            return h.get_tensor(name)

    def storage_format(self) -> str:
        """The dtype holding most of the weight bytes ("bf16", "fp32", "float8_e4m3fn", ...)."""
        by: dict[str, int] = {}
        for f in self.files:
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    sl = h.get_slice(k)
                    n = 1
                    for d in sl.get_shape():
                        n *= d
                    by[sl.get_dtype()] = by.get(sl.get_dtype(), 0) + n
        top = max(by, key=by.get) if by else "?"
        return {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(top, top.lower())

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def tensors(self, desc: str = "loading") -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, shard by shard, with a progress bar on loads that take a while."""
        bar = tqdm(total=len(self._where), desc=desc, unit="tensor", delay=1.0, leave=False)
        for f in self.files:
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    yield k, h.get_tensor(k)
                    bar.update()
        bar.close()


def read_generation_config(path: Path) -> dict:
    """generation_config.json as a dict ({} if absent); eos_token_id normalised to a list."""
    f = path / "generation_config.json"
    if not f.exists():
        return {}
    try:
        gen = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise LowbitError(f"{f} is not valid JSON ({e.msg})") from e
    eos = gen.get("eos_token_id")
    gen["eos_token_id"] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return gen
