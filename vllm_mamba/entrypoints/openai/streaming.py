"""What the completion and chat handlers share about delivering outputs: server-sent-event
framing, per-choice text deltas, merging the output streams of a batch of prompts, and
cancelling the work of a client that has gone away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel

from vllm_mamba.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
_END = object()


def sse(payload: BaseModel) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {payload.model_dump_json()}\n\n"


def sse_error(message: str, status: int) -> str:
    """One server-sent event carrying an OpenAI-shaped error (a stream that cannot go on)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    info = ErrorInfo(message=message, type=kind, code=status)
    return sse(ErrorResponse(error=info))


class TextDeltas:
    """Turns cumulative choice texts into the deltas a stream sends.

    While a choice is unfinished, its last `len(longest stop string) - 1` characters are held
    back: the engine cuts a matched stop string out of the text, and what was already sent
    must never need taking back. The streamed deltas thus add up to the non-streamed text.

    Args:
        stop: the request's stop strings.
    """

    def __init__(self, stop: list[str]) -> None:
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent_chars: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}

    def text(self, index: int, text: str, finished: bool) -> str:
        """The text of choice `index` not sent yet (and now marked sent)."""
        start = self.sent_chars.get(index, 0)
        end = len(text) if finished else max(len(text) - self.holdback, start)
        self.sent_chars[index] = end
        return text[start:end]

    def tokens(self, index: int, num_tokens: int) -> tuple[int, int]:
        """`(start, end)` of the tokens of choice `index` not sent yet (now marked sent)."""
        start = self.sent_tokens.get(index, 0)
        self.sent_tokens[index] = num_tokens
        return start, num_tokens


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleaves several async iterators as `(position, item)` in arrival order.

    Leaving early (or an error in one stream) cancels the iteration of every stream; streams
    never started are not closed, so the caller aborts their requests. The hand-over queue is
    bounded, so a consumer that stops reading stops the pumps too (and the engine sees the
    request's outputs go unread).
    """
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, _END))
        except Exception as err:
            await queue.put((i, err))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_disconnected(request: Request) -> None:
    """Returns once the client of `request` has disconnected (its body already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Runs `work` until it is done or the client disconnects, whichever comes first.

    Returns:
        The result of `work`, or None when the client went away (then `work` was cancelled,
        which aborts its requests).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None
