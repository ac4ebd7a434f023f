"""Turns a request's prompt into validated token ids, and checks its parameters against the
model: everything a request must pass before it enters the engine.

It holds its own tokenizer reference, so a server can run one on a worker thread (with its own
tokenizer copy) and keep tokenisation off both the event loop and the engine thread.

A prompt dict may also carry `"cache_points"`: token offsets inside the prompt where the prefix
cache should save a state snapshot while prefilling (where each chat message ends, say), so the
next request sharing that prefix hits even when this request was alone in the cache
(`cache_points`).

Those three are the only fields a prompt dict may have: any other (vLLM's `multi_modal_data`,
`mm_processor_kwargs`, ...) is refused by name rather than dropped, since the engine would
otherwise generate from the text alone.
"""

from __future__ import annotations

import weakref
from typing import Any

from vllm_mamba.sampling_params import SamplingParams

PromptInput = str | list[int] | dict[str, Any]

# The most cache points one prompt may carry: each may cut a prefill chunk and take a snapshot
# slot, so the count is bounded (a chat conversation needs a handful).
MAX_CACHE_POINTS = 64
# The fields of a prompt dict the engine uses.
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "cache_points")


_longest: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def longest_token(tokenizer: Any) -> int:
    """Characters of the tokenizer's longest vocabulary entry (at least 1), computed once per
    tokenizer object (engines of one process share a tokenizer: `tokenizer.cached_tokenizer`)."""
    try:
        return _longest[tokenizer]
    except (KeyError, TypeError):
        pass
    longest = max(max((len(t) for t in tokenizer.get_vocab()), default=1), 1)
    try:
        _longest[tokenizer] = longest
    except TypeError:  # not weakly referenceable
        pass
    return longest


class InputProcessor:
    """Validates prompts and sampling parameters for one model.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: rows of the model's embedding; token ids must be below it.
        max_model_len: the longest prompt plus output.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # No token spans more characters than the longest vocabulary entry, so a text longer
        # than this cannot fit in max_model_len tokens: it is refused before tokenising it.
        self.max_prompt_chars = max_model_len * longest_token(tokenizer)

    def process_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """Returns `(text or None, token ids)` of a prompt, validated.

        Raises:
            ValueError: empty, too long, not encodable, with token ids outside the
                vocabulary, or a dict with a field the engine does not use (naming it:
                `multi_modal_data`, say; only `PROMPT_FIELDS` are used).
        """
        text, ids = _split_prompt(prompt)
        if ids is None:
            ids = self.encode(text)
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        self.check_token_ids("prompt_token_ids", ids)
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long, more than max_model_len ({self.max_model_len})"
            )
        return text, ids

    def cache_points(self, prompt: PromptInput, num_tokens: int) -> list[int]:
        """The validated `"cache_points"` of a prompt dict of `num_tokens` tokens: sorted,
        without duplicates; `[]` when the prompt is not a dict or has none (or None).

        Each point is a token offset `p` with `0 < p < num_tokens`: the prefix
        `prompt_token_ids[:p]` is registered in the prefix cache as a node boundary while the
        request is live, so its prefill is cut there and a snapshot is saved there (when prefix
        caching is off they are accepted and ignored). At most `MAX_CACHE_POINTS` distinct
        points.

        Raises:
            ValueError: naming `cache_points`: not a list of integers, a point outside
                `(0, num_tokens)`, or more than `MAX_CACHE_POINTS` distinct points.
        """
        return check_cache_points(prompt, num_tokens)

    def encode(self, text: Any, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`.

        Raises:
            ValueError: not a string, far too long, or text the tokenizer cannot encode
                (such as lone surrogates).
        """
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string, got {type(text).__name__}")
        if len(text) > self.max_prompt_chars:
            raise ValueError(
                f"prompt is {len(text)} characters long: more than max_model_len "
                f"({self.max_model_len}) tokens can hold"
            )
        check_encodable("prompt", text)
        if not text:
            return []
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except (TypeError, ValueError, UnicodeError) as err:
            raise ValueError(f"prompt cannot be tokenized: {err}") from err

    def check_token_ids(self, name: str, ids: list[Any]) -> None:
        """Every id an integer in `[0, vocab_size)`.

        Raises:
            ValueError: naming `name` and the first bad ids.
        """
        vocab = self.vocab_size
        bad = [
            t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(f"{name} {bad[:5]} are outside the vocabulary [0, {vocab})")

    def check_params(self, params: SamplingParams) -> None:
        """The parts of `params` that depend on the model.

        Raises:
            ValueError: `top_k` above the vocabulary, or stop token ids, logit bias or allowed
                token ids outside it.
        """
        if params.top_k > self.vocab_size:
            raise ValueError(
                f"SamplingParams.top_k must be at most the vocabulary size ({self.vocab_size}), "
                f"got {params.top_k}"
            )
        self.check_token_ids("stop_token_ids", params.stop_token_ids or [])
        self.check_token_ids("SamplingParams.logit_bias", list(params.logit_bias or {}))
        self.check_token_ids("SamplingParams.allowed_token_ids", params.allowed_token_ids or [])


def check_encodable(name: str, text: str) -> None:
    """Refuses text that is not valid Unicode (lone surrogates cannot be UTF-8 encoded).

    Raises:
        ValueError: naming `name`.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{name} is not valid Unicode text (position {err.start}: {err.reason})"
        ) from err


def check_cache_points(prompt: PromptInput, num_tokens: int) -> list[int]:
    """See `InputProcessor.cache_points`."""
    if not isinstance(prompt, dict):
        return []
    points = prompt.get("cache_points")
    if points is None:
        return []
    if not isinstance(points, (list, tuple)) or any(
        isinstance(p, bool) or not isinstance(p, int) for p in points
    ):
        raise ValueError("cache_points must be a list of integer token offsets")
    bad = [p for p in points if not 0 < p < num_tokens]
    if bad:
        raise ValueError(
            f"cache_points {bad[:5]} are outside the prompt: each must be in (0, {num_tokens})"
        )
    unique = sorted(set(points))
    if len(unique) > MAX_CACHE_POINTS:
        raise ValueError(
            f"cache_points has {len(unique)} distinct offsets, more than {MAX_CACHE_POINTS}"
        )
    return unique


def _split_prompt(prompt: PromptInput) -> tuple[Any, list[Any] | None]:
    """`(text, ids or None)` of the accepted prompt shapes."""
    if isinstance(prompt, dict):
        unused = [key for key in prompt if key not in PROMPT_FIELDS]
        if unused:
            names = ", ".join(repr(key) for key in unused)
            raise ValueError(
                f"prompt field(s) {names} not supported: this engine serves text only and "
                f"uses only {', '.join(repr(f) for f in PROMPT_FIELDS)}"
            )
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise ValueError("prompt_token_ids must be a list of token ids")
            return prompt.get("prompt"), list(ids)
        if "prompt" in prompt:
            return prompt["prompt"], None
        raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise ValueError(f"prompt must be a string or token ids, got {type(prompt).__name__}")
