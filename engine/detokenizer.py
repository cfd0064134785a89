"""Incremental detokenization: text deltas that never split a multi-byte character.

Decoding token by token breaks characters whose bytes span tokens, and decoding single
tokens loses the spaces some tokenizers add by context. So each step decodes a short
window of recent ids twice (with and without the new ones) and emits the difference,
holding it back while it ends in an incomplete character (U+FFFD).
"""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0   # start of the context window
        self.read_offset = 0     # ids before this are already emitted
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (a trailing incomplete character is dropped)."""
        full = self.tok.decode(self.ids, skip_special_tokens=self.skip).rstrip("\ufffd")
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta
