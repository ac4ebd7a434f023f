"""The executor interface: the engine's one seam to where the model runs.

An executor starts one `worker.Worker` per rank (rank 0 in the engine's process) and is all
the engine sees of them. The engine asks it for the cache specs of rank 0's shard
(`cache_specs`), sizes the pools from them, has every rank allocate and bind its caches
(`init_caches`), has every rank build its runner with the engine's decisions
(`init_runner`) and then executes each step (`execute`): a `worker.step.Step`, plain data that
carries every state copy, snapshot and rollback the engine wants, in, a `worker.step.StepResult`
out; the engine calls nothing else during its life. A distributed executor sends each of these
calls to the other ranks before making it on rank 0's worker (every rank runs the same worker
code on the same step), and turns any failure of a rank into `TensorParallelError`, after which
the engine is dead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from vllm_mamba.config import EngineConfig
from vllm_mamba.distributed.parallel_state import TensorParallel
from vllm_mamba.errors import EngineDeadError
from vllm_mamba.kv_cache import KVCache, KVCacheSizing
from vllm_mamba.state_cache import StateCache
from vllm_mamba.worker.caches import CacheSpecs
from vllm_mamba.worker.model_runner import ModelRunner, RunnerConfig
from vllm_mamba.worker.platform import Platform
from vllm_mamba.worker.step import Step, StepResult
from vllm_mamba.worker.worker import Worker


class TensorParallelError(EngineDeadError):
    """A rank died, or a step failed on some rank: the ranks can no longer run in step."""


class Executor(ABC):
    """Runs the model for one engine.

    Attributes:
        tp: rank 0's place (its `size` is `tensor_parallel_size`).
        worker: rank 0's worker (in this process).
    """

    tp: TensorParallel
    config: EngineConfig
    device: torch.device
    worker: Worker

    @property
    def model(self) -> nn.Module:
        """Rank 0's model (the whole model with one rank)."""
        return self.worker.model

    @property
    def cache(self) -> StateCache:
        """Rank 0's state cache (after `init_caches`)."""
        assert self.worker.cache is not None, "init_caches first"
        return self.worker.cache

    @property
    def kv_cache(self) -> KVCache | None:
        """Rank 0's KV cache (None for an attention-free model)."""
        return self.worker.kv_cache

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's runner (after `init_runner`), for inspection."""
        assert self.worker.runner is not None, "init_runner first"
        return self.worker.runner

    @property
    def platform(self) -> Platform:
        """Rank 0's platform setup (its CPU threads now, its thread governor)."""
        return self.worker.platform

    def cache_specs(self) -> CacheSpecs:
        """Rank 0's cache specs (under tensor parallelism, its shard's)."""
        return self.worker.cache_specs()

    @abstractmethod
    def init_caches(self, num_slots: int, sizing: KVCacheSizing | None) -> None:
        """Allocates and binds every rank's caches: `num_slots` state slots each, and the KV
        pool of `sizing` (None: no KV cache)."""

    def init_runner(self, config: RunnerConfig) -> None:
        """Builds every rank's runner, configured with the engine's decisions."""
        self.worker.init_runner(config)

    @abstractmethod
    def execute(self, step: Step) -> StepResult:
        """Runs the step (on every rank) and returns rank 0's `StepResult`."""

    def watch(self, on_death: Callable[[BaseException], None]) -> None:  # noqa: B027
        """Calls `on_death(error)` (from another thread) when a rank dies; no-op with one."""

    def shutdown(self) -> None:  # noqa: B027
        """Stops the worker ranks (idempotent); no-op with one rank."""
