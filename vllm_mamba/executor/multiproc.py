"""`MultiprocExecutor` (vLLM's `mp` backend): ranks 1..N-1 in worker processes on this machine.

Each worker is a spawned process with a pipe from rank 0: it builds its rank's `Worker` (the
platform setup, joining the group, its shard), says `ready`, then runs rank 0's commands in
order until `shutdown` (or until rank 0's end of the pipe closes). A worker whose command fails
sends the traceback and exits.

A dead worker is noticed in bounded time: a monitor thread waits on the workers' process
sentinels and tells the watchers (the server's engine) at once; a step in flight fails when
its collective loses the peer (or after the group's timeout, `VLLM_MAMBA_DIST_TIMEOUT_S`).
Workers that exit because the engine stops (`shutdown`, the engine collected, or the
interpreter exiting with the engine still alive) are no failure: nothing is logged.

A worker process imports the script's main module again (as `__mp_main__`), so a script
that builds its engine at module level, without the `if __name__ == "__main__":` guard,
would start an engine in every worker: such a worker writes one line saying so and exits
with `EXIT_UNGUARDED_MAIN`, and rank 0's startup error says the same.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import pickle
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait

import torch

from vllm_mamba.config import EngineConfig
from vllm_mamba.distributed.parallel_state import (
    TensorParallel,
    collective_timeout_s,
    destroy_tensor_parallel,
    group_generation,
)
from vllm_mamba.errors import EngineStartupError
from vllm_mamba.executor.driver import DriverExecutor
from vllm_mamba.worker.relay import Command
from vllm_mamba.worker.worker import Worker, join_at

logger = logging.getLogger(__name__)

EXIT_WAIT_S = 2.0  # how long a failed step waits for a dying worker's exit status
EXIT_UNGUARDED_MAIN = 78  # a worker re-importing a main module without the __main__ guard
UNGUARDED_MAIN = (
    'the script that starts the engine must create it under `if __name__ == "__main__":` '
    "(tensor-parallel worker processes import the script again)"
)

# Set when the interpreter begins to exit: multiprocessing's exit handler (registered before
# this one, as `multiprocessing.connection` imports it, so it runs after) then ends the
# daemonic workers of engines still alive, which is no failure.
_exiting = threading.Event()
atexit.register(_exiting.set)


def exit_if_importing_main() -> None:
    """In a worker process still importing the script's main module (which built an engine
    at module level): one line on stderr, then exit with `EXIT_UNGUARDED_MAIN`, instead of
    multiprocessing's traceback."""
    if getattr(mp.current_process(), "_inheriting", False):
        sys.stderr.write(f"vllm_mamba: {UNGUARDED_MAIN}\n")
        sys.stderr.flush()
        os._exit(EXIT_UNGUARDED_MAIN)


def worker_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device on this machine: `cuda:rank`, or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _worker_main(
    config: EngineConfig, rank: int, size: int, init_method: str, conn: Connection
) -> None:
    """The body of a worker process."""
    try:
        device = worker_device(config.device, rank)
        worker = Worker(config, TensorParallel(rank, size), device, join=join_at(init_method))
        conn.send(("ready", None))
        while True:
            command: Command = pickle.loads(conn.recv_bytes())
            if command[0] == "shutdown":
                break
            worker.handle(command)
    except (EOFError, KeyboardInterrupt):
        return  # rank 0 is gone
    except BaseException as err:  # noqa: BLE001 - reported to rank 0, then this rank exits
        try:
            conn.send(("error", f"{err!r}\n{traceback.format_exc()}"))
        finally:
            raise SystemExit(1) from err


def _monitor(
    sentinels: list[int], executor: weakref.ref[MultiprocExecutor], stopping: threading.Event
) -> None:
    """Waits for any worker to exit; tells the executor's watchers unless it is gone or
    stopping, or the interpreter is exiting."""
    wait(sentinels)
    alive = executor()
    if alive is not None and not stopping.is_set() and not _exiting.is_set():
        alive._worker_died()


class MultiprocExecutor(DriverExecutor):
    """Rank 0 here, ranks 1..N-1 in spawned processes."""

    def __init__(self, config: EngineConfig) -> None:
        exit_if_importing_main()
        super().__init__(config)
        size = self.tp.size
        if config.device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(
                f"tensor_parallel_size {size} needs {size} GPUs on this machine with the mp "
                f"backend; {torch.cuda.device_count()} are visible (use the ray backend across "
                "machines)"
            )
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self._errors: dict[int, str] = {}
        self._stopping = threading.Event()
        self._start("127.0.0.1")
        self._generation = group_generation()
        # Dropping the engine (or exiting with it alive) stops its workers and leaves its
        # group, never a newer engine's (the monitor holds only a weak reference, so it does
        # not keep the executor alive).
        self._finalizer = weakref.finalize(
            self,
            MultiprocExecutor._stop,
            self.procs,
            self.conns,
            self._generation,
            self._stopping,
        )
        sentinels = [p.sentinel for p in self.procs]
        monitor = threading.Thread(
            target=_monitor,
            args=(sentinels, weakref.ref(self), self._stopping),
            name="tp-monitor",
            daemon=True,
        )
        monitor.start()

    def _start_workers(self, init_method: str) -> None:
        # A fork server with the engine's modules imported starts each worker in well under
        # a second after the first (nothing in it has touched CUDA or started threads);
        # transformers too, which unpickling the model's config imports (1-2 s a worker).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__, "transformers.configuration_utils"])
        size = self.tp.size
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(self.config, rank, size, init_method, child),
                name=f"vllm-mamba-tp{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + collective_timeout_s()
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.1):
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise EngineStartupError(f"tensor-parallel worker rank {rank} did not start")
            kind, detail = conn.recv()
            if kind != "ready":
                raise EngineStartupError(
                    f"tensor-parallel worker rank {rank} failed to start: {detail}"
                )

    def _send(self, command: Command) -> None:
        data = pickle.dumps(command)
        for conn in self.conns:
            conn.send_bytes(data)

    def _failed_ranks(self, wait_s: float = EXIT_WAIT_S) -> list[str]:
        deadline = time.monotonic() + wait_s
        failed = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if proc.is_alive() and wait_s > 0:
                proc.join(max(deadline - time.monotonic(), 0.0))
            error = self._read_error(rank, conn)
            if proc.is_alive() and error is None:
                continue
            line = f"worker rank {rank} (pid {proc.pid})"
            line += f" exited with code {proc.exitcode}" if not proc.is_alive() else " failed"
            if proc.exitcode == EXIT_UNGUARDED_MAIN:
                error = UNGUARDED_MAIN
            failed.append(line + (f": {error}" if error else ""))
        return failed

    def _read_error(self, rank: int, conn: Connection) -> str | None:
        """The error a worker reported before exiting, if any."""
        try:
            while rank not in self._errors and conn.poll(0):
                kind, detail = conn.recv()
                if kind == "error":
                    self._errors[rank] = detail.splitlines()[0]
        except (EOFError, OSError):
            pass
        return self._errors.get(rank)

    def _stop_workers(self) -> None:
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        MultiprocExecutor._stop(
            self.procs, self.conns, getattr(self, "_generation", None), self._stopping
        )

    @staticmethod
    def _stop(
        procs: list[mp.process.BaseProcess],
        conns: list[Connection],
        generation: int | None,
        stopping: threading.Event,
    ) -> None:
        """Asks each worker to exit (setting `stopping` first, so the monitor does not take
        their exits for failures); terminates those that do not within a few seconds; leaves
        the group of `generation` (any group when None)."""
        stopping.set()
        for conn in conns:
            try:
                conn.send_bytes(pickle.dumps(("shutdown",)))
            except OSError:
                pass
        for proc in procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
        for conn in conns:
            conn.close()
        destroy_tensor_parallel(generation)
