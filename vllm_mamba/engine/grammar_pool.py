"""Grammar compilation in worker processes, each compile under a time and a memory budget.

A structured-outputs grammar can take a minute and hundreds of megabytes to compile (a JSON
schema `enum` of 100,000 strings, an EBNF grammar of 50,000 rules). The server therefore never
compiles on a thread it shares with other requests: `GrammarCompilePool.compile` hands the
grammar to one of `workers` processes, each holding its own xgrammar compiler for the model's
tokenizer, and waits at most `timeout_s` for the compiled grammar (sent back serialized). A
worker over its time is killed (a new one starts on the next compile); a worker's address
space is capped at what it had after start-up plus `memory_bytes`, so a compile that needs more
fails there. Either way the caller gets a `StructuredOutputError` with a clean message.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
from multiprocessing.connection import Connection
from typing import Any

from vllm_mamba.engine.structured_outputs import (
    StructuredOutputError,
    clean_message,
    compile_source,
)

DEFAULT_MEMORY_BYTES = 2 * 2**30
_START_TIMEOUT_S = 300.0


def _address_space_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _serve(conn: Connection, tokenizer_info_json: str, memory_bytes: int) -> None:
    """A worker process: compiles `(method, text)` requests until its pipe closes."""
    import resource

    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False, max_threads=1)
    used = _address_space_bytes()
    if used and memory_bytes > 0:
        limit = used + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(("ready", ""))
    while True:
        try:
            method, text = conn.recv()
        except EOFError:
            return
        try:
            compiled = compile_source(compiler, method, text)
            conn.send(("ok", compiled.serialize_json()))
        except MemoryError:
            conn.send(("error", "it needs more memory than a grammar may use"))
        except Exception as err:  # xgrammar raises RuntimeError, ValueError, ...
            conn.send(("error", clean_message(err)))


class _Worker:
    """One compile process and its pipe."""

    def __init__(self, tokenizer_info_json: str, memory_bytes: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, tokenizer_info_json, memory_bytes), daemon=True
        )
        self.process.start()
        child.close()
        if not self.conn.poll(_START_TIMEOUT_S):
            self.kill()
            raise RuntimeError("the grammar compile worker did not start")
        self.conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()


class GrammarCompilePool:
    """Compiles grammars in `workers` processes; `compile` is thread-safe and blocks.

    Args:
        tokenizer_info: the model's `xgrammar.TokenizerInfo`.
        workers: processes compiling at once (more compiles wait for a free one).
        timeout_s: the most one compile may take.
        memory_bytes: the most memory one worker may add to what it had at start-up.
    """

    def __init__(
        self,
        tokenizer_info: Any,
        workers: int,
        timeout_s: float,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
    ) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError("grammar compile workers must be >= 1 and the timeout > 0")
        self.tokenizer_info = tokenizer_info
        self._info_json = tokenizer_info.serialize_json()
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._free: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(workers):
            self._free.put(None)  # started on first use
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()
        self._closed = False

    def compile(self, kind: str, method: str, text: str) -> Any:
        """The compiled grammar (`method`: json_schema, regex or grammar) of `text`.

        Raises:
            StructuredOutputError: it does not compile, or not within the time or memory.
        """
        worker = self._free.get()
        try:
            if worker is None:
                worker = self._start()
            worker.conn.send((method, text))
            if not worker.conn.poll(self.timeout_s):
                self._retire(worker)
                worker = None
                raise StructuredOutputError(
                    kind, f"it took more than {self.timeout_s:g} s to compile"
                )
            status, payload = worker.conn.recv()
        except (EOFError, OSError) as err:
            if worker is not None:
                self._retire(worker)
                worker = None
            raise StructuredOutputError(kind, "the grammar compiler failed") from err
        finally:
            self._free.put(worker)
        if status != "ok":
            raise StructuredOutputError(kind, payload)
        import xgrammar as xgr

        return xgr.CompiledGrammar.deserialize_json(payload, self.tokenizer_info)

    def _start(self) -> _Worker:
        worker = _Worker(self._info_json, self.memory_bytes)
        with self._lock:
            if self._closed:
                worker.kill()
                raise StructuredOutputError("grammar", "the server is shutting down")
            self._all.add(worker)
        return worker

    def _retire(self, worker: _Worker) -> None:
        with self._lock:
            self._all.discard(worker)
        worker.kill()

    def shutdown(self) -> None:
        """Kills every worker (a compile in progress fails)."""
        with self._lock:
            self._closed = True
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.kill()
