"""Loads the tokenizer of a model directory (or of a separate tokenizer path)."""

from __future__ import annotations

from typing import Any


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from `path`.

    Raises:
        FileNotFoundError: no tokenizer files are there.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"no usable tokenizer in {path!r}: {err}") from err
