"""EngineConfig: every engine setting in one dataclass. CLI flags are generated from its
fields (`max_model_len` -> `--max-model-len`), named as vLLM names them."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineConfig:
    model: str = "demo"
    dtype: str = _opt("auto", "compute dtype: auto (bf16 on GPU, float32 on CPU), bfloat16, float16, float32")
    device: str | None = _opt(None, "cpu or cuda[:N]; default: cuda when present")
    max_model_len: int | None = _opt(None, "context length; default: the model's max_position_embeddings")
    random_weights: bool = _opt(False, "build the model from --config with seeded random weights (no checkpoint)")
    config: str | None = _opt(None, "config.json giving the shape for --random-weights")
    tokenizer: str | None = _opt(None, "tokenizer directory (default: the model directory)")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)) -> None:
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_ = f.metadata.get("help")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=help_)
                continue
            typ = int if "int" in str(f.type) else (float if "float" in str(f.type) else str)
            parser.add_argument(flag, type=typ, default=f.default, help=help_,
                                choices=f.metadata.get("choices"))

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    def llm_kwargs(self) -> dict:
        return dataclasses.asdict(self)
