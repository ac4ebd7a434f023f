"""Incremental detokenization: the text each new token adds, without re-decoding everything.

Fast tokenizers use `tokenizers`' own `DecodeStream` (seeded with a few prompt tokens of
context), which emits a token's text once it decodes to valid UTF-8. Other tokenizers decode a
small window: the tokens since the last emitted text (plus a few tokens of context), so that a
token completing a multi-byte character or a word piece is only emitted once it decodes cleanly.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        # A context that ends inside a multi-byte character would be re-emitted by the
        # stream; such prompts take the window path.
        if not self._decode(self.ids).endswith("\ufffd"):
            self._stream = _decode_stream(self._backend, self.ids, skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Appends `token_id` and returns the text it completes (possibly empty)."""
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        return self._add_window(token_id)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _add_window(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            # Keep the window short: drop ids that no longer matter.
            if self.prefix_offset > 64:
                del self.ids[: self.prefix_offset]
                self.read_offset -= self.prefix_offset
                self.prefix_offset = 0
            return full[len(prefix) :]
        return ""


def _decode_stream(backend: Any, context: list[int], skip_special_tokens: bool) -> Any:
    """A `DecodeStream` primed with `context`, or None for a slow tokenizer."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    if not isinstance(backend, Tokenizer):
        return None
    try:
        return DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
    except TypeError:  # tokenizers without context priming
        return DecodeStream(skip_special_tokens=skip_special_tokens)


def find_stop_string(text: str, new_len: int, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string that ends inside the last `new_len` characters of `text`.

    Returns:
        `(stop, index)` of the earliest match, or None.
    """
    best: tuple[str, int] | None = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best
