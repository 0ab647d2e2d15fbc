"""Prompts to token ids: plain text, and chat messages through the model's template.

Message content is user data: text such as "<|im_end|>" inside it must stay text, not
become the special token (which would let a user forge turns). So the template is
rendered with a marker in place of each content string; the template's own text is
encoded with special tokens recognised, and each content string with special tokens
encoded as plain text.
"""

from __future__ import annotations

import logging
import re

from tokenizers import Tokenizer as _Tok

from lowbit.checkpoint.tokenizer import Tokenizer
from lowbit.errors import LowbitError

log = logging.getLogger("lowbit")

ROLES = ("system", "user", "assistant", "tool", "developer")
_MARK = "\x00lowbit-content-{}\x00"
_MARK_RE = re.compile("\x00lowbit-content-(\\d+)\x00")


def message_text(content) -> str:
    """OpenAI content: a string, or a list of parts of which only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise LowbitError("message content parts must be {'type': 'text', 'text': ...}; "
                                  "this model reads text only")
            texts.append(part["text"])
        return "".join(texts)
    raise LowbitError("message content must be a string or a list of text parts")


class PromptEncoder:
    """Encodes prompts and chats with one tokenizer (and a plain-text twin of it)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.plain = _Tok.from_str(tokenizer.tok.to_str())
        self.plain.encode_special_tokens = True  # special-token text stays text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        contents, marked = [], []
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise LowbitError(f"each message needs a role among {', '.join(ROLES)}")
            marked.append({**m, "content": _MARK.format(len(contents))})
            contents.append(message_text(m.get("content")))
        if not messages:
            raise LowbitError("messages must not be empty")
        rendered = self.tokenizer.apply_chat_template(marked, add_generation_prompt)
        pieces = _MARK_RE.split(rendered)  # template, index, template, index, ...
        if len(pieces) != 2 * len(contents) + 1:
            log.warning("the chat template transforms message content; encoding it as rendered")
            real = [{**m, "content": c} for m, c in zip(messages, contents)]
            return self.encode(self.tokenizer.apply_chat_template(real, add_generation_prompt), False)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                ids += self.encode(piece, add_special_tokens=False) if piece else []
            else:
                ids += self.plain.encode(contents[int(piece)], add_special_tokens=False).ids
        return ids
