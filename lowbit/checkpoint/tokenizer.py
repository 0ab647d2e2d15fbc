"""Tokenizer (the `tokenizers` package) plus the chat template rendered with jinja2."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as _Tok

from lowbit.errors import LowbitError


def _token_text(t) -> str | None:
    return t.get("content") if isinstance(t, dict) else t


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        f = path / "tokenizer.json"
        if not f.exists():
            raise LowbitError(f"{path} has no tokenizer.json; lowbit needs a fast-tokenizer file")
        self.tok = _Tok.from_file(str(f))
        cfg_file = path / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        template = self.config.get("chat_template")
        jf = path / "chat_template.jinja"
        if jf.exists():
            template = jf.read_text()
        self.chat_template = template
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tok.token_to_id(text)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise LowbitError("this model's tokenizer has no chat template; send a plain prompt")
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True,
                                 undefined=jinja2.ChainableUndefined)

        def raise_exception(msg: str):
            raise LowbitError(f"chat template refused the messages: {msg}")

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )
