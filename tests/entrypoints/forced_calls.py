"""Required and named tool choices checked through a running server with the `openai`
client: what every answer must be, and the helpers that read a streamed one.

A sampled request under a tool grammar is never a server error: it ends with a complete call
(arguments valid JSON under the tool's schema; `tool_calls`, or `stop` for a named choice), or
it was cut by `max_tokens` and finishes with `length` and the call generated so far. A stream
sends no empty content, and its call pieces carry only what OpenAI's do: the first piece of a
call `index`, `id`, `type` and the function's name and arguments, the later ones `index` and
argument text.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai

from tests.entrypoints.conftest import API_KEY, MODEL_NAME

QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


class _AnyText:
    """Equal to any string (the argument text of a stream piece)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, str)


ANY_TEXT = _AnyText()


def read_stream(chunks: list[Any]) -> tuple[str, str | None, list[dict[str, str]]]:
    """`(content, finish_reason, calls)` of one choice's streamed chunks, each call as
    `{"id", "name", "arguments"}` joined from its pieces by index (as the openai SDK's
    stream helper does); asserts the pieces' shape and that no delta has empty content."""
    content, finish, calls = "", None, {}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            assert delta.content != "" or delta.role == "assistant", chunk
            content += delta.content or ""
            finish = choice.finish_reason or finish
            for piece in delta.tool_calls or []:
                sent = piece.model_dump(exclude_unset=True)
                if piece.index not in calls:
                    assert sent.keys() == {"index", "id", "type", "function"}, sent
                    assert sent["type"] == "function", sent
                    assert sent["function"].keys() == {"name", "arguments"}, sent
                    calls[piece.index] = {"id": piece.id, "name": piece.function.name}
                    calls[piece.index]["arguments"] = ""
                else:
                    assert sent == {"index": piece.index, "function": {"arguments": ANY_TEXT}}, sent
                calls[piece.index]["arguments"] += piece.function.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, finish, [calls[i] for i in sorted(calls)]


async def forced_call(
    api: openai.AsyncOpenAI, stream: bool, **kwargs: Any
) -> tuple[str | None, str | None, list[dict[str, str]]]:
    """`(content, finish_reason, calls)` of a one-choice chat, streamed or not."""
    args = {"model": MODEL_NAME, "messages": QUESTION, **kwargs}
    if not stream:
        choice = (await api.chat.completions.create(**args)).choices[0]
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or []
        ]
        return choice.message.content, choice.finish_reason, calls
    chunks = [c async for c in await api.chat.completions.create(stream=True, **args)]
    content, finish, calls = read_stream(chunks)
    return content or None, finish, calls


def check_forced_calls_over_seeds(
    url: str, tools: list[dict[str, Any]], seeds: int, max_tokens: int = 24
) -> None:
    """Required and named choices sampled at temperature 1 over `seeds` seeds, streamed and
    not (at once): no error, and each answer a complete call or a `length` finish whose calls
    are what the same seed generates with room to finish, cut short."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    named = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}

    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300
        ) as api:
            jobs = [
                forced_call(
                    api,
                    stream,
                    tools=tools,
                    tool_choice=choice,
                    temperature=1.0,
                    seed=seed,
                    max_tokens=room,
                    parallel_tool_calls=choice != "required" or seed % 2 == 1,
                )
                for seed in range(seeds)
                for choice in ("required", named)
                for stream in (False, True)
                for room in (max_tokens, 300)
            ]
            return await asyncio.gather(*jobs)

    replies = iter(asyncio.run(run()))
    finished = cut = 0
    for seed in range(seeds):
        for choice in ("required", named):
            for _stream in (False, True):
                content, finish, calls = next(replies)
                full_content, full_finish, full_calls = next(replies)
                assert content is None and full_content is None
                assert full_finish == ("tool_calls" if choice == "required" else "stop"), seed
                assert full_calls, seed
                for call in full_calls:
                    jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
                if finish == "length":  # the same calls, cut short
                    cut += 1
                    assert len(calls) <= len(full_calls)
                    for got, want in zip(calls, full_calls):
                        assert got["name"] == want["name"]
                        assert want["arguments"].startswith(got["arguments"]), (got, want)
                    for got, want in zip(calls[:-1], full_calls):
                        assert got["arguments"] == want["arguments"]
                else:
                    finished += 1
                    assert (finish, [c["arguments"] for c in calls]) == (
                        full_finish,
                        [c["arguments"] for c in full_calls],
                    )
    assert finished and cut, (finished, cut)
