"""Rank 0's side of tensor parallelism: every model call of a step is first sent to the other
ranks, so that all ranks run the same step (`DriverModel`, `DriverMambaCache`,
`DriverKVCache`), and `DriverExecutor`, the base of the executors with worker ranks.

The `ModelRunner` is unchanged: it calls rank 0's model and caches through these wrappers.
Rank 0 alone samples; the other ranks only take part in the collectives.
"""

from __future__ import annotations

import logging
import socket
import threading
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vllm_mamba.cache_specs import KVSpec, StateSpec
from vllm_mamba.config import EngineConfig
from vllm_mamba.distributed.communication import broadcast
from vllm_mamba.distributed.parallel_state import (
    TensorParallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from vllm_mamba.engine.model_runner import StepResult
from vllm_mamba.errors import EngineStartupError
from vllm_mamba.executor.base import Executor, TensorParallelError, make_caches
from vllm_mamba.executor.worker import Command, metadata_to
from vllm_mamba.kv_cache import KVCache, KVCacheSizing
from vllm_mamba.mamba_cache import MambaCache
from vllm_mamba.model_loader import build_model, check_tensor_parallel

logger = logging.getLogger(__name__)

Send = Callable[[Command], None]
CPU = torch.device("cpu")


class DriverModel:
    """Rank 0's model as the runner sees it: each call is sent to the other ranks first."""

    def __init__(self, model: nn.Module, send: Send, tp: TensorParallel) -> None:
        self.model = model
        self.send = send
        self.tp = tp

    def __call__(self, input_ids: torch.Tensor, meta: Any) -> torch.Tensor:
        """The step's forward on every rank; rank 0's hidden states `(T, H)`."""
        self.send(("forward", input_ids.to(CPU), metadata_to(meta, CPU)))
        return self.model(input_ids, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `(R, V)` of rows `hidden (R, H)`, each rank scoring its vocabulary rows."""
        hidden = hidden.contiguous()
        self.send(("logits", tuple(hidden.shape), hidden.dtype))
        broadcast(hidden, self.tp)
        return self.model.compute_logits(hidden)


class DriverMambaCache(MambaCache):
    """Rank 0's state cache; slot copies (forks, snapshots) are made on every rank."""

    def __init__(
        self, specs: list[StateSpec], num_slots: int, device: torch.device, send: Send
    ) -> None:
        super().__init__(specs, num_slots, device)
        self.send = send

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copies slots `src[i]` into `dst[i]` on every rank."""
        if src:
            self.send(("copy_slots", list(src), list(dst)))
        super().copy_slots(src, dst)


class DriverKVCache(KVCache):
    """Rank 0's KV cache; block copies are made on every rank."""

    def __init__(
        self, specs: list[KVSpec], sizing: KVCacheSizing, device: torch.device, send: Send
    ) -> None:
        super().__init__(specs, sizing, device)
        self.send = send

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copies blocks `src[i]` into `dst[i]` on every rank."""
        if src:
            self.send(("copy_blocks", list(src), list(dst)))
        super().copy_blocks(src, dst)


def free_port(host: str) -> int:
    """A TCP port free on `host` now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
        """Starts the workers, joins the group at `host`, loads rank 0's shard."""
        init_method = f"tcp://{host}:{free_port(host)}"
        self._start_workers(init_method)
        try:
            self._join_group(init_method)
            mc = self.config.model_config
            self.model, _ = build_model(mc.path, mc.hf_config, mc.dtype, self.device, self.tp)
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.runner_model = DriverModel(self.model, self.send, self.tp)
        logger.info(
            "Tensor parallelism: %d ranks (%s backend), rank 0 in this process",
            self.tp.size,
            self.config.parallel_config.distributed_executor_backend,
        )

    def _join_group(self, init_method: str) -> None:
        """Joins the group (on a helper thread) while watching that no worker failed."""
        errors: list[BaseException] = []

        def join() -> None:
            try:
                init_tensor_parallel(self.tp, init_method, self.device)
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
        """Every rank's caches, each of its own shard's specs and bound to it; rank 0's copy
        slots and blocks on every rank."""
        self.send(("init_caches", num_slots, sizing))
        self.cache, self.kv_cache = make_caches(
            self.model, self.config, num_slots, sizing, self.device,
            state_cls=lambda *a: DriverMambaCache(*a, self.send),
            kv_cls=lambda *a: DriverKVCache(*a, self.send),
        )  # fmt: skip

    def execute(self, step: Any) -> StepResult:
        """The step on every rank.

        Raises:
            TensorParallelError: a rank died or the step failed on some rank; the ranks are
                out of step, so the engine cannot go on.
        """
        if self._dead is not None:
            raise self._dead
        try:
            return self.runner.execute(step)
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
