"""`RayExecutor` (`distributed_executor_backend="ray"`): ranks 1..N-1 as Ray actors.

Rank 0 stays in the engine's process; each other rank is an actor (one CPU, or one GPU on
CUDA) placed by Ray on any node of the cluster, so one model can span machines. Commands go
to the actors as ordered calls of `handle`; a rank whose command fails exits its process, so
the collectives of the others fail at once. A second, separate method (`wait_for_exit`, in
its own concurrency group) never returns while the actor lives: the monitor thread waits on
it and reports a dead rank within moments.

The group's rendezvous is rank 0's address as Ray sees it (`tcp://<node ip>:<port>`); gloo and
NCCL choose their network interface from `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` when a
machine has several. Ray is an optional dependency (`pip install vllm-mamba[ray]`).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch

from vllm_mamba.config import EngineConfig
from vllm_mamba.distributed.parallel_state import TensorParallel, collective_timeout_s
from vllm_mamba.executor.driver import DriverExecutor
from vllm_mamba.worker.relay import Command
from vllm_mamba.worker.worker import Worker, join_at

logger = logging.getLogger(__name__)


def _import_ray() -> Any:
    """The `ray` module.

    Raises:
        ValueError: Ray is not installed.
    """
    try:
        import ray
    except ImportError as err:
        raise ValueError(
            "distributed_executor_backend 'ray' needs Ray: pip install 'vllm-mamba[ray]'"
        ) from err
    return ray


class RayWorker:
    """The body of a worker actor (wrapped by `ray.remote` in `RayExecutor`)."""

    def __init__(self, config: EngineConfig, rank: int, size: int, init_method: str) -> None:
        device = torch.device("cuda", 0) if config.device.type == "cuda" else config.device
        self.worker = Worker(config, TensorParallel(rank, size), device, join=join_at(init_method))
        self._exit = threading.Event()

    def ready(self) -> int:
        """Returns this actor's process id once the shard is loaded."""
        return os.getpid()

    def handle(self, command: Command) -> None:
        """Runs one command; on failure this rank exits (the others' collectives fail)."""
        try:
            self.worker.handle(command)
        except BaseException:
            logger.exception("tensor-parallel rank %d failed; exiting", self.worker.tp.rank)
            os._exit(1)

    def wait_for_exit(self) -> None:
        """Blocks while the actor lives (the driver's monitor waits on it)."""
        self._exit.wait()


def _actor_class(ray: Any) -> Any:
    """`RayWorker` as an actor class whose `wait_for_exit` runs in its own concurrency group
    (the commands stay ordered in the default group of one)."""
    wait = ray.method(concurrency_group="monitor")(RayWorker.wait_for_exit)
    cls = type("RayWorkerActor", (RayWorker,), {"wait_for_exit": wait})
    return ray.remote(concurrency_groups={"monitor": 1})(cls)


class RayExecutor(DriverExecutor):
    """Rank 0 here, ranks 1..N-1 as Ray actors (local or across a Ray cluster)."""

    def __init__(self, config: EngineConfig) -> None:
        self.ray = _import_ray()
        super().__init__(config)
        if not self.ray.is_initialized():
            self.ray.init(ignore_reinit_error=True, log_to_driver=True)
        self.actors: list[Any] = []
        self._pending: list[Any] = []
        self._start(self.ray.util.get_node_ip_address())
        sentinels = [a.wait_for_exit.remote() for a in self.actors]
        threading.Thread(
            target=self._monitor, args=(sentinels,), name="tp-ray-monitor", daemon=True
        ).start()

    def _start_workers(self, init_method: str) -> None:
        ray = self.ray
        resources = {"num_gpus": 1} if self.device.type == "cuda" else {"num_cpus": 1}
        actor_cls = _actor_class(ray)
        for rank in range(1, self.tp.size):
            actor = actor_cls.options(**resources).remote(
                self.config, rank, self.tp.size, init_method
            )
            self.actors.append(actor)

    def _wait_ready(self) -> None:
        self.ray.get([a.ready.remote() for a in self.actors], timeout=collective_timeout_s())

    def _send(self, command: Command) -> None:
        self._pending = [a.handle.remote(command) for a in self.actors] + self._pending[-64:]

    def _failed_ranks(self, wait_s: float = 2.0) -> list[str]:
        failed = []
        for rank, actor in enumerate(self.actors, start=1):
            try:
                self.ray.get(actor.ready.remote(), timeout=max(wait_s, 0.01))
            except self.ray.exceptions.GetTimeoutError:
                continue  # alive, busy in a command
            except Exception as err:  # noqa: BLE001 - a dead actor, whatever Ray calls it
                failed.append(f"worker rank {rank} (Ray actor) died: {type(err).__name__}")
        return failed

    def _monitor(self, sentinels: list[Any]) -> None:
        """Waits until any actor's `wait_for_exit` call fails (the actor died)."""
        self.ray.wait(sentinels, num_returns=1, timeout=None)
        self._worker_died()

    def _stop_workers(self) -> None:
        for actor in getattr(self, "actors", []):
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
