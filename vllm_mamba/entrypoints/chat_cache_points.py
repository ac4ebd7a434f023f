"""Where a chat prompt's messages end, in tokens: the prefix cache's `cache_points`.

A Mamba state after token `i` exists only if it was saved at token `i`, so a request alone in
the prefix cache leaves no snapshot where the next conversation sharing its system prompt
diverges. Passing the message ends of a chat prompt as the prompt dict's `"cache_points"` (see
`vllm_mamba.engine.input_processor`) saves a snapshot there, and the next request with the same
system prompt (or the same earlier turns) starts from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_mamba.entrypoints.chat_utils import render_budget

__all__ = ["chat_cache_points"]


def chat_cache_points(
    render: Callable[[list[dict[str, Any]]], str],
    messages: list[dict[str, Any]],
    prompt_text: str,
    prompt_ids: list[int],
    encode: Callable[[str], list[int]],
    max_points: int = 8,
) -> list[int]:
    """Token offsets in `prompt_ids` where messages of the conversation end, sorted.

    The candidates are the ends of `messages[:k]` for `k` in `1 .. len(messages) - 1`: always
    the first message's (the system prompt, shared by most requests), then the last few before
    the final message, `max_points` in all. For each, `messages[:k]` is rendered; a render that
    raises (templates may refuse a partial conversation, e.g. one not ending with a user
    message) or whose text is not a prefix of `prompt_text` gives no point. The text is encoded
    and the point is the length of the longest common prefix of its ids with `prompt_ids`:
    tokenization may merge tokens across the boundary, and the common prefix is what a later
    request with the same messages shares. Points `<= 0` or `>= len(prompt_ids)` are dropped.

    Cost: one render and one encode per candidate point (at most `max_points`), each of a
    prefix of the prompt. The renders continue the time budget of the last render on this
    thread (`render_budget(resume=True)`: call it right after rendering `prompt_text`, on the
    same thread), so a request's template runs for at most one `RENDER_TIMEOUT_S` in all; once
    that is spent the remaining points are dropped. Call it off the event loop.

    Args:
        render: renders a conversation prefix WITHOUT the generation prompt (the same template
            and options that rendered `prompt_text`).
        messages: the conversation `prompt_text` was rendered from.
        prompt_text: the rendered prompt.
        prompt_ids: its token ids, as sent to the engine.
        encode: the tokenizer's encode, adding no special tokens (as `prompt_ids` was encoded,
            so a leading BOS the template renders as text is in both).
        max_points: the most points returned (0 or less: none).

    Returns:
        Distinct offsets `p` with `0 < p < len(prompt_ids)`, ascending: the prompt dict's
        `"cache_points"`.
    """
    if max_points <= 0 or len(messages) < 2:
        return []
    ends = range(1, len(messages))  # k: messages[:k] ends before the final message
    chosen = [1, *ends[1:][-(max_points - 1) :]] if max_points > 1 else [1]
    points: set[int] = set()
    for k in chosen:
        try:
            with render_budget(resume=True):
                text = render(messages[:k])
        except Exception:  # noqa: BLE001 - a template may refuse a partial conversation
            continue
        if not isinstance(text, str) or not text or not prompt_text.startswith(text):
            continue
        ids = encode(text)
        point = _common_len(ids, prompt_ids)
        if 0 < point < len(prompt_ids):
            points.add(point)
    return sorted(points)


def _common_len(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
