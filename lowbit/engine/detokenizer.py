"""Incremental detokenizer: emits text only once it is whole UTF-8 (no split characters).

Each new token decodes a short window of recent ids instead of the whole sequence: the
window starts at the previous emission point (`prefix_offset`) so merges and leading-space
rules see some context, and the text the window held before the new tokens (`read_offset`)
is cut off to leave the new piece. Cost per token is constant, not the sequence length.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # a multibyte character is still incomplete, or the token has no text
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before):]
