"""`AsyncLLMEngine`: the synchronous `LLMEngine` shared by many asyncio callers (the server).

One background task steps the engine while it has work. Every call into the engine (adding,
aborting, stepping) runs on one dedicated worker thread, so the event loop never blocks on a
model step and the engine, which is not thread-safe, is only ever touched by that thread, one
call at a time. Each request has its own `asyncio.Queue` of `RequestOutput`s, which
`generate` turns into an async iterator; leaving that iterator early (the client went away,
the task was cancelled) aborts the request and frees its state slots.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from vllm_mamba.engine.llm_engine import LLMEngine, PromptInput
from vllm_mamba.outputs import RequestOutput
from vllm_mamba.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The background loop failed; the engine cannot serve more requests."""


class AsyncLLMEngine:
    """Streams the outputs of an `LLMEngine` to asyncio callers.

    Args:
        engine: the engine to drive; only this object's worker thread touches it afterwards.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._closed = False

    @classmethod
    def from_args(cls, **kwargs: Any) -> AsyncLLMEngine:
        """Loads a model with `LLMEngine.from_args(**kwargs)` and wraps it."""
        return cls(LLMEngine.from_args(**kwargs))

    # ----- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Starts the background loop on the running event loop (idempotent)."""
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    async def shutdown(self) -> None:
        """Aborts every request still in flight, stops the loop and the worker thread."""
        if self._closed:
            return
        stopped = EngineDeadError("the engine is shutting down")
        for queue in self._queues.values():
            queue.put_nowait(stopped)
        await self.call(self.engine.abort_request, list(self._queues))
        self._queues.clear()
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        self._executor.shutdown(wait=True)

    @property
    def is_running(self) -> bool:
        """True while the background loop is alive."""
        return self._loop_task is not None and not self._loop_task.done()

    @property
    def errored(self) -> bool:
        """True once the background loop has failed."""
        return self._error is not None

    # ----- requests --------------------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Adds a request and returns the iterator of its outputs.

        The caller must iterate the result to its end, or close it, or call `abort`:
        leaving it early (closing it, or cancelling the task iterating it) aborts the
        request and frees its slots.

        Args:
            request_id: unique among requests in flight.
            prompt: a string, token ids, or a `{"prompt_token_ids": [...]}` dict.
            params: the request's sampling parameters.

        Returns:
            An async iterator of the request's cumulative `RequestOutput`s, one after every
            step that gave it tokens; the last one has `finished=True`.

        Raises:
            ValueError: a bad prompt or parameters (nothing entered the engine).
            EngineDeadError: the engine is shut down or its loop failed.
        """
        if self._error is not None or self._closed:
            raise EngineDeadError(f"the engine is not serving (error: {self._error!r})")
        self.start()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            await self.call(self.engine.add_request, request_id, prompt, params)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        self._work.set()
        return self._stream(request_id, queue)

    async def generate(
        self, prompt: PromptInput, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """`add_request`, then yields the request's outputs (see there)."""
        stream = await self.add_request(request_id, prompt, params)
        async for out in stream:
            yield out

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Aborts a request between two steps and frees its slots; never blocks."""
        self._queues.pop(request_id, None)
        if not self._closed:
            self._executor.submit(self.engine.abort_request, request_id)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs `fn(*args)` on the engine thread, serialized with the steps.

        Use it for anything that touches the engine or its tokenizer.
        """
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ----- the loop --------------------------------------------------------------------
    async def _run_loop(self) -> None:
        try:
            while True:
                if not self.engine.has_unfinished_requests():
                    # An add completes on the worker thread before its caller sets `_work`,
                    # so checking here and clearing right before the wait loses no wakeup.
                    self._work.clear()
                    await self._work.wait()
                    continue
                for out in await self.call(self.engine.step):
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            logger.exception("engine loop failed")
            self._error = err
            dead = EngineDeadError(f"the engine loop failed: {err!r}")
            for queue in self._queues.values():
                queue.put_nowait(dead)
            self._queues.clear()
