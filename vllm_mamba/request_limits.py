"""The most one request may ask for in each list- or text-valued field.

Every per-request preprocessing step is linear in its input, and these bounds keep the input
small enough that none of them, nor the grammar compile behind a structured-outputs field,
holds a shared thread for long. A request over a limit is a `ValueError` naming the field (a
400 from the server); the README lists them.
"""

from __future__ import annotations

MAX_STOP = 64  # stop strings
MAX_STOP_CHARS = 16_384  # all stop strings together
MAX_STOP_TOKEN_IDS = 1_024
MAX_BAD_WORDS = 256
MAX_BAD_WORDS_CHARS = 16_384  # all bad words together
MAX_LOGIT_BIAS_ENTRIES = 1_024
MAX_ALLOWED_TOKEN_IDS = 262_144
MAX_GRAMMAR_BYTES = 131_072  # a JSON schema (as JSON text), regex or EBNF grammar
MAX_CHOICES = 1_024  # structured_outputs.choice / guided_choice entries
MAX_CHOICE_CHARS = 65_536  # all choices together
MAX_TOOLS = 128
MAX_TOOLS_BYTES = 262_144  # the tools' definitions as JSON text


def over_count(name: str, count: int, limit: int) -> str | None:
    """A message when `count` entries of `name` are more than `limit` (else None)."""
    if count > limit:
        return f"{name} has {count} entries, more than the limit of {limit}"
    return None


def over_size(name: str, size: int, limit: int, unit: str = "characters") -> str | None:
    """A message when `name` is `size` units long, more than `limit` (else None)."""
    if size > limit:
        return f"{name} is {size} {unit} long, more than the limit of {limit}"
    return None
