"""Engine log-probabilities (`{token_id: Logprob}` per position) in OpenAI's two shapes: the
legacy completions lists and the chat `content` entries.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_mamba.entrypoints.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from vllm_mamba.outputs import Logprob, PositionLogprobs


def _top(entry: PositionLogprobs, k: int) -> list[Logprob]:
    """The `k` best alternatives of a position, best first."""
    return sorted(entry.values(), key=lambda lp: lp.rank)[:k]


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[PositionLogprobs | None],
    texts: Sequence[str],
    top_k: int,
    text_offset: int = 0,
) -> CompletionLogprobs:
    """The legacy `logprobs` object of some consecutive tokens.

    Args:
        token_ids: the tokens.
        entries: one per token; None where a position has no score (the first prompt token).
        texts: the text of each token.
        top_k: how many alternatives each position lists (the chosen token is added).
        text_offset: the offset of the first token in the choice's text.

    Returns:
        Parallel lists `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`.
    """
    out = CompletionLogprobs()
    offset = text_offset
    for token_id, entry, text in zip(token_ids, entries, texts):
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        chosen = entry[token_id]
        out.token_logprobs.append(chosen.logprob)
        top = {lp.decoded_token or "": lp.logprob for lp in _top(entry, top_k)}
        top.setdefault(text, chosen.logprob)
        out.top_logprobs.append(top)
    return out


def join_logprobs(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    """The legacy logprobs of `first`'s tokens followed by `second`'s (offsets kept as given)."""
    return CompletionLogprobs(
        text_offset=first.text_offset + second.text_offset,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs,
    )


def token_texts(token_ids: Sequence[int], entries: Sequence[PositionLogprobs | None]) -> list[str]:
    """The text of each token from its logprob entry ("" where there is none)."""
    texts = []
    for token_id, entry in zip(token_ids, entries):
        lp = entry.get(token_id) if entry is not None else None
        texts.append((lp.decoded_token or "") if lp is not None else "")
    return texts


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[PositionLogprobs], top_k: int
) -> ChatLogprobs:
    """The chat `logprobs` object of some consecutive generated tokens.

    Args:
        token_ids: the generated tokens.
        entries: one per token, holding the top alternatives and the chosen token.
        top_k: how many alternatives each position lists.
    """
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        text = chosen.decoded_token or ""
        top = [
            TopLogprob(**_chat_entry(lp.decoded_token or "", lp.logprob))
            for lp in _top(entry, top_k)
        ]
        content.append(ChatTokenLogprob(**_chat_entry(text, chosen.logprob), top_logprobs=top))
    return ChatLogprobs(content=content)


def prompt_logprobs_json(
    entries: Sequence[PositionLogprobs | None] | None, k: int
) -> list[dict[str, dict] | None] | None:
    """vLLM's `prompt_logprobs` of a response: per prompt position (the first is null), the
    top-`k` tokens and the prompt's own, as token id -> `{logprob, rank, decoded_token}`."""
    if entries is None:
        return None
    out: list[dict[str, dict] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda item: item[1].rank)
        keep = {tid: lp for tid, lp in ranked[:k]}
        keep.update({tid: lp for tid, lp in entry.items() if lp.rank > k})
        out.append(
            {
                str(tid): {
                    "logprob": lp.logprob,
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }
                for tid, lp in keep.items()
            }
        )
    return out
