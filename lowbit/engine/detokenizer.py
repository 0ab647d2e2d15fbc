"""Incremental detokenizer: emits text only once it is whole UTF-8 (no split characters)."""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # text emitted so far

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        if full.endswith("\ufffd") or not full.startswith(self.text):
            return ""  # a multibyte character is still incomplete
        new, self.text = full[len(self.text):], full
        return new
