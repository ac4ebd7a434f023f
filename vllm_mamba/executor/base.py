"""The executor interface: the engine's one seam to where the model runs.

The executor owns the model (each rank its shard), the caches and the `ModelRunner`. The
engine asks it for the cache specs of rank 0's shard (`cache_specs`: each recurrent layer's
state spec and each attention layer's KV spec, read off the built layers), sizes the pools
from them, has every rank allocate and bind its caches (`init_caches`), builds the runner
(`init_runner`) and then executes each scheduled step (`execute`). A distributed executor hands
the runner forwarding wrappers so that every rank runs the same step, and turns any failure of
a rank into `TensorParallelError`, after which the engine is dead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm_mamba.attention.backend import AttentionBackend
from vllm_mamba.cache_specs import KVSpec, StateSpec
from vllm_mamba.config import EngineConfig
from vllm_mamba.distributed.parallel_state import TensorParallel
from vllm_mamba.engine.model_runner import ModelRunner, StepResult
from vllm_mamba.engine.structured_outputs import StructuredOutputs
from vllm_mamba.errors import EngineDeadError
from vllm_mamba.kv_cache import KVCache, KVCacheSizing
from vllm_mamba.layers.cache_layers import kv_cache_layers
from vllm_mamba.mamba_cache import MambaCache, state_specs_of


class TensorParallelError(EngineDeadError):
    """A rank died, or a step failed on some rank: the ranks can no longer run in step."""


@dataclass(frozen=True)
class CacheSpecs:
    """One shard's cache specs, in module order: its recurrent layers' state specs (dtypes
    resolved) and its attention layers' KV specs."""

    state: list[StateSpec]
    kv: list[KVSpec]

    def state_bytes_per_slot(self) -> int:
        """State bytes one sequence holds in this shard."""
        return sum(s.bytes_per_slot() for s in self.state)


def cache_specs_of(model: nn.Module, config: EngineConfig) -> CacheSpecs:
    """The specs of `model`'s layers (`ssm_state_dtype` applied to the recurrent states)."""
    dtype = config.model_config.dtype
    state = state_specs_of(model, dtype, config.ssm_state_dtype)
    return CacheSpecs(state, [layer.kv_spec(dtype) for layer in kv_cache_layers(model)])


def make_caches(
    model: nn.Module,
    config: EngineConfig,
    num_slots: int,
    sizing: KVCacheSizing | None,
    device: torch.device,
    state_cls: Callable[..., MambaCache] = MambaCache,
    kv_cls: Callable[..., KVCache] = KVCache,
) -> tuple[MambaCache, KVCache | None]:
    """This rank's state cache (and KV cache, with a sizing), bound to its layers."""
    specs = cache_specs_of(model, config)
    cache = state_cls(specs.state, num_slots, device)
    cache.bind(model)
    kv_cache = None
    if specs.kv and sizing is not None:
        kv_cache = kv_cls(specs.kv, sizing, device)
        kv_cache.bind(model)
    return cache, kv_cache


class Executor(ABC):
    """Runs the model for one engine.

    Attributes:
        tp: rank 0's place (its `size` is `tensor_parallel_size`).
        model: rank 0's model (the whole model with one rank).
        runner_model: what the `ModelRunner` calls (`model`, or rank 0's forwarding wrapper).
        cache, kv_cache: rank 0's caches, after `init_caches`.
        runner: the runner, after `init_runner`.
    """

    tp: TensorParallel
    model: nn.Module
    runner_model: Any
    config: EngineConfig
    device: torch.device
    cache: MambaCache
    kv_cache: KVCache | None
    runner: ModelRunner

    def cache_specs(self) -> CacheSpecs:
        """Rank 0's cache specs (under tensor parallelism, its shard's)."""
        return cache_specs_of(self.model, self.config)

    @abstractmethod
    def init_caches(self, num_slots: int, sizing: KVCacheSizing | None) -> None:
        """Allocates and binds every rank's caches: `num_slots` state slots each, and the KV
        pool of `sizing` (None: no KV cache)."""

    def init_runner(
        self,
        backend: type[AttentionBackend],
        eos_token_id: int | None,
        structured_outputs: StructuredOutputs | None,
    ) -> ModelRunner:
        """Builds the runner over rank 0's model and caches."""
        self.runner = ModelRunner(
            self.runner_model, self.cache, backend, self.device,
            self.config.model_config.seed, eos_token_id, structured_outputs, self.kv_cache,
        )  # fmt: skip
        return self.runner

    @abstractmethod
    def execute(self, step: Any) -> StepResult:
        """Runs the scheduled step (on every rank) and returns rank 0's `StepResult`."""

    def watch(self, on_death: Callable[[BaseException], None]) -> None:  # noqa: B027
        """Calls `on_death(error)` (from another thread) when a rank dies; no-op with one."""

    def shutdown(self) -> None:  # noqa: B027
        """Stops the worker ranks (idempotent); no-op with one rank."""
