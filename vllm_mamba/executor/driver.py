"""`DriverExecutor`, the base of the executors with worker ranks: rank 0's `Worker` in this
process, ranks 1..N-1 started by a subclass (processes, Ray actors).

It starts the other ranks, joins the group with them (watching that none failed meanwhile),
builds rank 0's worker, sends every other rank each call it makes on rank 0's worker first
(`init_caches`, `init_runner`, `execute` with the same plain-data step: `worker.relay`), so
every rank runs the same worker code, and turns a failure of any rank into
`TensorParallelError`. Every rank samples the same tokens; rank 0's result goes to the engine.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections.abc import Callable

import torch.distributed as dist

from vllm_mamba.config import EngineConfig
from vllm_mamba.distributed.parallel_state import (
    TensorParallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
    open_rendezvous,
)
from vllm_mamba.errors import EngineStartupError
from vllm_mamba.executor.base import Executor, TensorParallelError
from vllm_mamba.kv_cache import KVCacheSizing
from vllm_mamba.model_loader import check_tensor_parallel
from vllm_mamba.worker.model_runner import RunnerConfig
from vllm_mamba.worker.relay import Command
from vllm_mamba.worker.step import Step, StepResult
from vllm_mamba.worker.worker import Worker

logger = logging.getLogger(__name__)


class DriverExecutor(Executor):
    """Rank 0 in this process; subclasses start and talk to ranks 1..N-1.

    Subclasses implement `_start_workers`, `_send` and `_failed_ranks`, and call `_start`.
    """

    def __init__(self, config: EngineConfig) -> None:
        check_tensor_parallel(
            config.model_config.hf_config, size := config.parallel_config.tensor_parallel_size
        )
        self.config = config
        self.device = config.device
        self.tp = TensorParallel(0, size)
        self._watchers: list[Callable[[BaseException], None]] = []
        self._dead: TensorParallelError | None = None
        self._fail_lock = threading.Lock()
        self._closed = False

    def _start(self, host: str) -> None:
        """Starts the workers, then rank 0's: it joins the group at `host` and loads its
        shard."""
        store, init_method = open_rendezvous(host, self.tp.size)
        self._start_workers(init_method)
        try:
            self.worker = Worker(
                self.config,
                self.tp,
                self.device,
                join=lambda tp, device: self._join_group(init_method, store),
            )
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "Tensor parallelism: %d ranks (%s backend), rank 0 in this process",
            self.tp.size,
            self.config.parallel_config.distributed_executor_backend,
        )

    def _join_group(self, init_method: str, store: dist.Store) -> None:
        """Joins the group through rank 0's rendezvous `store` (on a helper thread) while
        watching that no worker failed."""
        errors: list[BaseException] = []

        def join() -> None:
            try:
                init_tensor_parallel(self.tp, init_method, self.device, store)
            except BaseException as err:  # noqa: BLE001 - re-raised on the calling thread
                errors.append(err)

        thread = threading.Thread(target=join, name="tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            failed = self._failed_ranks(wait_s=0.0)
            if failed:
                raise EngineStartupError(f"tensor parallelism could not start: {'; '.join(failed)}")
        if errors:
            raise errors[0]

    @abstractmethod
    def _start_workers(self, init_method: str) -> None:
        """Starts ranks 1..N-1, which join the group at `init_method` and load their shards."""

    @abstractmethod
    def _wait_ready(self) -> None:
        """Returns once every worker has loaded its shard; raises if one failed."""

    @abstractmethod
    def _send(self, command: Command) -> None:
        """Sends `command` to every worker rank, in order."""

    @abstractmethod
    def _failed_ranks(self, wait_s: float = 2.0) -> list[str]:
        """A line for each worker rank that died or failed (waiting up to `wait_s` for a
        dying worker's exit status)."""

    def send(self, command: Command) -> None:
        """Sends `command` to every worker rank (a dead rank raises `TensorParallelError`)."""
        if self._dead is not None:
            raise self._dead
        self._send(command)

    def init_caches(self, num_slots: int, sizing: KVCacheSizing | None) -> None:
        """Every rank's caches, each of its own shard's specs and bound to it."""
        self.send(("init_caches", num_slots, sizing))
        self.worker.init_caches(num_slots, sizing)

    def init_runner(self, config: RunnerConfig) -> None:
        """Every rank's runner, configured with the engine's decisions."""
        self.send(("init_runner", config))
        self.worker.init_runner(config)

    def execute(self, step: Step) -> StepResult:
        """The step on every rank (sent to the others first); rank 0's result.

        Raises:
            TensorParallelError: a rank died or the step failed on some rank; the ranks are
                out of step, so the engine cannot go on.
        """
        if self._dead is not None:
            raise self._dead
        try:
            self.send(("execute", step))
            return self.worker.execute(step)
        except Exception as err:
            raise self._fail(err) from err

    def _fail(self, err: BaseException | None) -> TensorParallelError:
        """Records and returns the error that ends this executor (the engine thread and the
        monitor may both find it; the first one words it)."""
        with self._fail_lock:
            return self._fail_locked(err)

    def _fail_locked(self, err: BaseException | None) -> TensorParallelError:
        if self._dead is None:
            failed = self._failed_ranks()
            what = "; ".join(failed) if failed else f"a step failed on rank 0: {err!r}"
            self._dead = TensorParallelError(
                f"tensor parallelism ({self.tp.size} ranks) failed: {what}; the engine cannot go on"
            )
            logger.error("%s", self._dead)
        return self._dead

    def watch(self, on_death: Callable[[BaseException], None]) -> None:
        """Calls `on_death(error)` (from a monitor thread) when a worker rank dies."""
        self._watchers.append(on_death)
        if self._dead is not None:
            on_death(self._dead)

    def _worker_died(self) -> None:
        """Called by the subclass's monitor when a worker is gone."""
        if self._closed:
            return
        err = self._fail(None)
        for on_death in list(self._watchers):
            on_death(err)

    def shutdown(self) -> None:
        """Stops the workers and leaves the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop_workers()
        destroy_tensor_parallel()  # idempotent (the mp backend's stop already left the group)

    @abstractmethod
    def _stop_workers(self) -> None:
        """Asks the workers to exit, and makes sure they do."""
