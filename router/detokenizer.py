"""Incremental detokenization: text deltas that never split a multi-byte character.

A tokenizer backed by the `tokenizers` library (every "fast" transformers tokenizer) streams
through its `DecodeStream`: one step in Rust per token, about 1 us, where decoding a window
twice in Python took about 9 (the router pays it for every token of every request). Any other
tokenizer, one that cleans up spaces around punctuation after decoding (which `DecodeStream`
does not), and a prompt that ends inside a character decode a small window (``prefix_offset ..
end``) and emit what extends the window's previous text. Either way a tail that decodes to
U+FFFD (an incomplete UTF-8 sequence) is held back until it completes, and `flush` gives what
is left at the end.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

# Prompt ids decoded before the first output token, so its leading space comes out right.
CONTEXT_IDS = 4


class Detokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids or [])[-CONTEXT_IDS:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        # A context that ends inside a character would come out again as output text.
        cut = backend is not None and self._decode(self.ids).endswith("\ufffd")
        self.backend = None if cleans_up or cut else backend
        if self.backend is not None:
            self.stream = DecodeStream(ids=list(self.ids), skip_special_tokens=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.backend is not None:
            text = self.stream.step(self.backend, token_id)
            if text is None:
                return ""
            # What is emitted so far: the window restarts after it (used by `flush` only).
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end of generation)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
