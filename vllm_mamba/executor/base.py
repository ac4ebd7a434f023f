"""The executor interface: the engine's one seam to where the model runs.

The engine asks its executor for the model (rank 0's shard), the state and KV caches, and to
execute each scheduled step with the `ModelRunner`. A distributed executor hands the runner a
forwarding model (`runner_model`) so that every rank runs the same step, and turns any failure
of a rank into `TensorParallelError`, after which the engine is dead.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from torch import nn

from vllm_mamba.distributed.parallel_state import TensorParallel
from vllm_mamba.engine.errors import EngineDeadError
from vllm_mamba.kv_cache import AttentionSpec, KVCache, KVCacheSizing
from vllm_mamba.mamba_cache import MambaCache, MambaStateShape


class TensorParallelError(EngineDeadError):
    """A rank died, or a step failed on some rank: the ranks can no longer run in step."""


class Executor(ABC):
    """Runs the model for one engine.

    Attributes:
        tp: rank 0's place (its `size` is `tensor_parallel_size`).
        model: rank 0's model (the whole model with one rank).
        runner_model: what the `ModelRunner` calls (`model`, or rank 0's forwarding wrapper).
    """

    tp: TensorParallel
    model: nn.Module
    runner_model: Any

    @abstractmethod
    def make_state_cache(self, shape: MambaStateShape, num_slots: int) -> MambaCache:
        """The state cache of every rank; returns rank 0's (`shape` is the whole model's)."""

    @abstractmethod
    def make_kv_cache(self, specs: list[AttentionSpec], sizing: KVCacheSizing) -> KVCache:
        """The KV cache of every rank, bound to its model; returns rank 0's."""

    @abstractmethod
    def execute(self, runner: Any, step: Any) -> Any:
        """Runs `runner.execute(step)` (on every rank) and returns rank 0's `StepResult`."""

    def watch(self, on_death: Callable[[BaseException], None]) -> None:  # noqa: B027
        """Calls `on_death(error)` (from another thread) when a rank dies; no-op with one."""

    def shutdown(self) -> None:  # noqa: B027
        """Stops the worker ranks (idempotent); no-op with one rank."""


def local_state_shape(model: nn.Module, shape: MambaStateShape) -> MambaStateShape:
    """The per-slot state of this rank's shard: the channel / head counts of its mixers."""
    mixer = next((m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "conv1d")), None)
    if mixer is None:
        return shape
    conv = (mixer.conv1d.weight.shape[0], *shape.conv_shape[1:])
    ssm = (mixer.A_log.shape[0], *shape.ssm_shape[1:])
    return dataclasses.replace(shape, conv_shape=conv, ssm_shape=ssm)


def local_kv_specs(model: nn.Module, specs: list[AttentionSpec]) -> list[AttentionSpec]:
    """The KV cache specs of this rank's shard: the KV heads its attention layers hold."""
    layers = [m for m in model.modules() if hasattr(m, "bind_kv_cache")]
    assert len(layers) == len(specs), (len(layers), len(specs))
    return [dataclasses.replace(s, num_kv_heads=m.num_kv_heads) for s, m in zip(specs, layers)]
