"""`AsyncLLMEngine`: the synchronous `LLMEngine` shared by many asyncio callers (the server).

One background task steps the engine while it has work. Every call into the engine (adding,
aborting, stepping) runs on one dedicated worker thread, so the event loop never blocks on a
model step and the engine, which is not thread-safe, is only ever touched by that thread, one
call at a time. Tokenisation, detokenisation and chat-template rendering run on a second
worker (`run_tokenizer`) with its own tokenizer copy, so a huge prompt stalls neither the event
loop nor the steps of other requests.

Each request has its own output box (`_Outputs`), which `generate` turns into an async
iterator. Outputs are cumulative, so the box holds only the newest one: a slow consumer skips
intermediate outputs instead of queueing them, and a request's undelivered outputs take
constant memory. An output left unread for `pause_after_s` (a fraction of a second: far longer
than a reading consumer takes, since it reads while the next step runs) pauses the request:
the engine stops scheduling it (`LLMEngine.pause_request`), so it takes no step time from the
others and its memory does not grow, until its consumer takes the output, which resumes it
exactly where it stopped. An output left unread for `stall_timeout_s` (a streaming client that
stopped reading) aborts the request, freeing its slots. One API request may hold at most
`max_slots_per_request` state slots (`n` times its prompts). The box is dropped on every path
(finished, aborted, failed). Leaving the
iterator early (the client went away, the task was cancelled) aborts the request and frees its
state slots. A step that fails ends only its own requests; an unrecoverable failure marks the
engine dead and calls `on_dead` (the server then exits non-zero); so does a tensor-parallel
worker that dies, even while the engine is idle (the executor's monitor reports it).

After every step the engine thread hands over a `StatsSnapshot` (`stats`), which `/metrics`
and the periodic statistics line read.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from vllm_mamba.config import ModelConfig
from vllm_mamba.engine import native_memory
from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.engine.grammar_pool import GrammarCompilePool
from vllm_mamba.engine.input_processor import InputProcessor, PromptInput
from vllm_mamba.engine.llm_engine import LLMEngine
from vllm_mamba.engine.stats import StatLogger, StatsSnapshot
from vllm_mamba.engine.structured_outputs import grammar_source
from vllm_mamba.errors import EngineDeadError, RequestsFailedError
from vllm_mamba.outputs import RequestOutput
from vllm_mamba.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
Item = RequestOutput | BaseException

DEFAULT_PAUSE_AFTER_S = 0.1


# Threads that preprocess requests' images (resizing, patches), beside the tokenizer thread.
IMAGE_THREADS = 2
# The most seconds a request's images may take to preprocess.
IMAGE_PREPROCESS_TIMEOUT_S = 30.0


class StreamStalledError(RequestsFailedError):
    """A request whose outputs were left unread too long; it was aborted."""

    def __init__(self, request_id: str, stall_s: float) -> None:
        cause = TimeoutError(f"its output was not read for {stall_s:g} s")
        super().__init__([request_id], cause)
        self.args = (f"the request was aborted: its output was not read for {stall_s:g} s",)


class _Outputs:
    """A request's undelivered output: the newest cumulative one (it replaces an older one),
    or an error (which nothing replaces); `since` is when it started waiting; `paused` while
    the engine holds the request until the output is taken."""

    def __init__(self) -> None:
        self.item: Item | None = None
        self.since: float | None = None
        self.paused = False
        self._ready = asyncio.Event()

    @property
    def in_progress(self) -> bool:
        """True when the waiting output is of a request still generating."""
        return isinstance(self.item, RequestOutput) and not self.item.finished

    def put(self, item: Item) -> None:
        if isinstance(self.item, BaseException):
            return
        self.item = item
        if self.since is None:
            self.since = time.monotonic()
        self._ready.set()

    async def get(self) -> Item:
        while self.item is None:
            self._ready.clear()
            await self._ready.wait()
        item, self.item, self.since = self.item, None, None
        return item


__all__ = ["AsyncLLMEngine", "EngineDeadError"]


class AsyncLLMEngine:
    """Streams the outputs of an `LLMEngine` to asyncio callers.

    Args:
        engine: the engine to drive; only this object's worker thread touches it afterwards.
        on_dead: called once, on the event loop, if the engine fails beyond recovery.
        log_requests: log every request's prompt and parameters when it is added.
        grammar_workers: processes compiling structured-output grammars at once.
        grammar_timeout_s: the most one grammar compile may take.
        pause_after_s: stop scheduling a request whose output waits unread this long, until
            it is read (None: never).
        stall_timeout_s: abort a request whose output waits unread this long (None: never).
        max_slots_per_request: the most state slots one `add_requests` call may take
            (default: half of `max_num_seqs`, at least 1).
    """

    def __init__(
        self,
        engine: LLMEngine,
        on_dead: Callable[[BaseException], None] | None = None,
        log_requests: bool = False,
        grammar_workers: int = 2,
        grammar_timeout_s: float = 10.0,
        pause_after_s: float | None = DEFAULT_PAUSE_AFTER_S,
        stall_timeout_s: float | None = 30.0,
        max_slots_per_request: int | None = None,
    ) -> None:
        self.engine = engine
        self.on_dead = on_dead
        self.log_requests = log_requests
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._image_pool = ThreadPoolExecutor(IMAGE_THREADS, thread_name_prefix="images")
        self._grammar_threads = ThreadPoolExecutor(grammar_workers, thread_name_prefix="grammar")
        self._grammar_workers = grammar_workers
        self._grammar_timeout_s = grammar_timeout_s
        self._grammar_pool: GrammarCompilePool | None = None
        mc = engine.config.model_config
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.inputs = InputProcessor(
            self.tokenizer, mc.vocab_size, mc.max_model_len, engine.inputs.images
        )
        self.stats: StatsSnapshot = engine.stats_snapshot()
        self._stat_logger = StatLogger() if engine.config.log_stats else None
        self.pause_after_s = pause_after_s
        self.stall_timeout_s = stall_timeout_s
        max_seqs = engine.config.scheduler_config.max_num_seqs
        self.max_slots_per_request = max_slots_per_request or max(1, max_seqs // 2)
        self._queues: dict[str, _Outputs] = {}
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._closed = False

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLMEngine:
        """Loads `args.model` into a new `LLMEngine` and wraps it (`kwargs`: see the class)."""
        return cls(LLMEngine.from_engine_args(args), **kwargs)

    @property
    def model_config(self) -> ModelConfig:
        """What is loaded (read-only after startup)."""
        return self.engine.config.model_config

    @property
    def num_requests(self) -> int:
        """Requests with an open output queue (for tests of the bookkeeping)."""
        return len(self._queues)

    # ----- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Starts the background loop on the running event loop (idempotent)."""
        if self._loop_task is None or self._loop_task.done():
            loop = asyncio.get_running_loop()
            self._loop_task = loop.create_task(self._run_loop())
            self.engine.executor.watch(lambda err: loop.call_soon_threadsafe(self._die, err))

    async def shutdown(self) -> None:
        """Aborts every request still in flight, stops the loop and the worker thread."""
        if self._closed:
            return
        stopped = EngineDeadError("the engine is shutting down")
        for queue in self._queues.values():
            queue.put(stopped)
        await self.call(self.engine.abort_request, list(self._queues))
        self._queues.clear()
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        self._executor.shutdown(wait=True)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._image_pool.shutdown(wait=False, cancel_futures=True)
        if self._grammar_pool is not None:
            self._grammar_pool.shutdown()
        self._grammar_threads.shutdown(wait=False, cancel_futures=True)
        self.engine.executor.shutdown()

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
            prompt: a string, token ids, or a `{"prompt_token_ids": [...]}` dict (which may
                carry `"cache_points"`: see `InputProcessor.cache_points`).
            params: the request's sampling parameters.

        Returns:
            An async iterator of the request's cumulative `RequestOutput`s, one after every
            step that gave it tokens; the last one has `finished=True`.

        Raises:
            ValueError: a bad prompt or parameters (nothing entered the engine).
            EngineDeadError: the engine is shut down or its loop failed.
        """
        return (await self.add_requests([(request_id, prompt)], params))[0]

    async def add_requests(
        self, requests: list[tuple[str, PromptInput]], params: SamplingParams
    ) -> list[AsyncIterator[RequestOutput]]:
        """Adds several requests in one engine call (the prompts of one API request), so that
        they enter the same step: requests sharing a prefix then start from one prefix-cache
        snapshot. All or none are added.

        Raises:
            ValueError: a bad prompt or parameters (nothing entered the engine).
            EngineDeadError: the engine is shut down or its loop failed.
        """
        self._check_alive()
        slots = len(requests) * params.n
        if slots > self.max_slots_per_request:
            raise ValueError(
                f"SamplingParams.n times the prompts ({len(requests)} x {params.n} = {slots}) "
                f"is more than the {self.max_slots_per_request} sequences one request may run"
            )
        self.start()
        tokenized = []
        for request_id, prompt in requests:
            prompt = await self.preprocess_images(prompt)
            text, ids, mm = await self.run_tokenizer(self.inputs.process, prompt)
            points = self.inputs.cache_points(prompt, len(ids), mm)
            processed = {"prompt": text, "prompt_token_ids": ids, "cache_points": points}
            if mm is not None:  # preprocessed here, off the engine thread
                processed["multi_modal_data"] = mm
            tokenized.append((request_id, processed))
        self._check_alive()
        queues: list[_Outputs] = []
        for request_id, _ in requests:
            queues.append(_Outputs())
            self._queues[request_id] = queues[-1]
        try:
            await self.call(self._add_all, tokenized, params)
        except BaseException:
            for request_id, _ in requests:
                self._queues.pop(request_id, None)
            raise
        self._work.set()
        return [self._stream(rid, q) for (rid, _), q in zip(requests, queues)]

    def _add_all(self, tokenized: list[tuple[str, dict]], params: SamplingParams) -> None:
        """Adds every request on the engine thread, or none (the added ones are aborted)."""
        added: list[str] = []
        try:
            for request_id, prompt in tokenized:
                if self.log_requests:
                    text = prompt["prompt"]
                    shown = (
                        repr(text[:200])
                        if text is not None
                        else f"{len(prompt['prompt_token_ids'])} token ids"
                    )
                    logger.info(
                        "Received request %s: prompt: %s, params: %s", request_id, shown, params
                    )
                self.engine.add_request(request_id, prompt, params)
                added.append(request_id)
        except BaseException:
            self.engine.abort_request(added)
            raise

    async def generate(
        self, prompt: PromptInput, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """`add_request`, then yields the request's outputs (see there)."""
        stream = await self.add_request(request_id, prompt, params)
        async for out in stream:
            yield out

    def _check_alive(self) -> None:
        if self._error is not None or self._closed:
            raise EngineDeadError(f"the engine is not serving (error: {self._error!r})")

    async def _stream(self, request_id: str, queue: _Outputs) -> AsyncIterator[RequestOutput]:
        ended = False  # finished, or failed: nothing is left in the engine
        try:
            while not ended:
                item = await queue.get()
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                if queue.paused:
                    self._resume(request_id, queue)
                ended = item.finished
                yield item
        finally:
            if self._queues.get(request_id) is queue:
                del self._queues[request_id]
            if not ended:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Aborts a request between two steps and frees its slots; never blocks."""
        self._queues.pop(request_id, None)
        if not self._closed:
            self._executor.submit(self.engine.abort_request, request_id)

    def _resume(self, request_id: str, queue: _Outputs) -> None:
        """Its consumer took the output: the engine schedules the request again."""
        queue.paused = False
        if not self._closed:
            self._executor.submit(self.engine.resume_request, request_id)
            self._work.set()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs `fn(*args)` on the engine thread, serialized with the steps.

        Use it for anything that touches the engine itself.
        """
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compiles `spec` in the grammar pool's processes (never on the tokenizer or engine
        thread) unless it is cached, and attaches the result to `spec` for `add_request`.

        Raises:
            StructuredOutputError: it does not compile, or not within the budget.
        """
        grammars = self.engine.structured_outputs
        if not grammars.has_compiler:
            await self.call(grammars.ensure_compiler)
        compiled = grammars.cached(spec)
        if compiled is None:
            if self._grammar_pool is None:
                self._grammar_pool = GrammarCompilePool(
                    grammars.tokenizer_info, self._grammar_workers, self._grammar_timeout_s
                )
            method, text = grammar_source(spec)
            compiled = await asyncio.get_running_loop().run_in_executor(
                self._grammar_threads, self._grammar_pool.compile, spec.kind, method, text
            )
            grammars.put(spec, compiled)
        spec.compiled = compiled

    async def preprocess_images(self, prompt: PromptInput) -> PromptInput:
        """The prompt's images through the image processor on the image threads, within
        `IMAGE_PREPROCESS_TIMEOUT_S` (`InputProcessor.preprocess_images`).

        Raises:
            ValueError: a bad image, or preprocessing over its time budget.
        """
        if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
            return prompt
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._image_pool, self.inputs.preprocess_images, prompt)
        try:
            return await asyncio.wait_for(work, IMAGE_PREPROCESS_TIMEOUT_S)
        except TimeoutError as err:
            raise ValueError(
                f"multi_modal_data: preprocessing the images took more than "
                f"{IMAGE_PREPROCESS_TIMEOUT_S:.0f} s"
            ) from err

    async def run_tokenizer(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs `fn(*args)` on the tokenizer thread (`self.tokenizer`, chat templates)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    # ----- the loop --------------------------------------------------------------------
    def _step(self) -> tuple[list[RequestOutput], bool]:
        """One engine step on the engine thread; publishes the stats snapshot after it."""
        try:
            return self.engine.step(), self.engine.has_unpaused_requests()
        finally:
            self.stats = self.engine.stats_snapshot()
            native_memory.trim()  # at most once per TRIM_INTERVAL_S

    def _idle_check(self) -> bool:
        """On the engine thread: True while requests that are not paused remain; else hands
        free heap pages back to the system before the loop sleeps (what the finished requests
        freed)."""
        if self.engine.has_unpaused_requests():
            return True
        native_memory.trim()
        return False

    async def _run_loop(self) -> None:
        has_work = True
        try:
            while True:
                if not has_work:
                    # An add completes on the worker thread before its caller sets `_work`,
                    # so clearing before asking the engine thread loses no wakeup.
                    self._work.clear()
                    if not await self.call(self._idle_check):
                        await self._wait_for_work()
                    self._hold_unread()
                    has_work = True
                    continue
                try:
                    outputs, has_work = await self.call(self._step)
                except RequestsFailedError as err:
                    self._fail_requests(err)
                    outputs = err.outputs  # the step's other requests, when it ran
                for out in outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put(out)
                self._hold_unread()
                if self._stat_logger is not None:
                    self._stat_logger.maybe_log(self.stats)
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            self._die(err)

    async def _wait_for_work(self) -> None:
        """Sleeps until a request is added or resumed, or until the oldest unread output
        reaches the stall timeout (paused requests run no steps after which to check it)."""
        waiting = [q.since for q in self._queues.values() if q.since is not None]
        if self.stall_timeout_s is None or not waiting:
            await self._work.wait()
            return
        delay = min(waiting) + self.stall_timeout_s - time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._work.wait(), max(delay, 0.0))

    def _hold_unread(self) -> None:
        """Pauses the requests whose output has waited unread for `pause_after_s`; aborts
        those whose output has waited for `stall_timeout_s`."""
        now = time.monotonic()
        for request_id, queue in list(self._queues.items()):
            if queue.since is None:
                continue
            unread = now - queue.since
            if self.stall_timeout_s is not None and unread >= self.stall_timeout_s:
                logger.warning("aborting request %s: its client stopped reading", request_id)
                queue.put(StreamStalledError(request_id, self.stall_timeout_s))
                self.abort(request_id)
            elif (
                self.pause_after_s is not None
                and unread >= self.pause_after_s
                and not queue.paused
                and queue.in_progress
            ):
                queue.paused = True
                self._executor.submit(self.engine.pause_request, request_id)

    def _fail_requests(self, err: RequestsFailedError) -> None:
        """Ends the streams of the requests of a failed step with the error."""
        for request_id in err.request_ids:
            queue = self._queues.pop(request_id, None)
            if queue is not None:
                queue.put(err)

    def _die(self, err: BaseException) -> None:
        if self._error is not None:
            return
        logger.critical("the engine failed beyond recovery: %r", err, exc_info=err)
        self._error = err
        dead = EngineDeadError(f"the engine loop failed: {err!r}")
        for queue in self._queues.values():
            queue.put(dead)
        self._queues.clear()
        if self.on_dead is not None:
            self.on_dead(err)
