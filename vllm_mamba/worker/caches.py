"""One rank's caches: the specs read off its shard, their allocation and binding, and the slot
and block copies the runner asks for.

`CacheCopies` is the small protocol between the runner and whoever makes its copies (forks,
prefix-cache snapshots and hits, speculative rollbacks, copy-on-write KV blocks):
`LocalCopies` copies in this process's caches, on every rank (under tensor parallelism each
rank runs the same step, so it makes the same copies in its own shard's caches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from vllm_mamba.cache_specs import KVSpec, StateSpec
from vllm_mamba.config import EngineConfig
from vllm_mamba.kv_cache import KVCache, KVCacheSizing
from vllm_mamba.layers.cache_layers import kv_cache_layers
from vllm_mamba.state_cache import StateCache, state_specs_of


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
) -> tuple[StateCache, KVCache | None]:
    """This rank's state cache (and KV cache, with a sizing), bound to its layers."""
    specs = cache_specs_of(model, config)
    cache = StateCache(specs.state, num_slots, device)
    cache.bind(model)
    kv_cache = None
    if specs.kv and sizing is not None:
        kv_cache = KVCache(specs.kv, sizing, device)
        kv_cache.bind(model)
    return cache, kv_cache


class CacheCopies(Protocol):
    """The runner's copies between state slots and between KV blocks."""

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copies every state of slot `src[i]` into slot `dst[i]`."""
        ...

    def rollback_slots(self, chains: Sequence[tuple[int, list[int], int]]) -> None:
        """Brings each `(start, positions, slot)`'s state to its last kept chain position
        (`StateCache.rollback`)."""
        ...

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copies KV block `src[i]` into block `dst[i]` (only called with a KV cache)."""
        ...


class LocalCopies:
    """`CacheCopies` in this process's caches."""

    def __init__(self, cache: StateCache, kv_cache: KVCache | None) -> None:
        self.cache = cache
        self.kv_cache = kv_cache

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copies the slots in the state cache."""
        self.cache.copy_slots(list(src), list(dst))

    def rollback_slots(self, chains: Sequence[tuple[int, list[int], int]]) -> None:
        """Rolls the slots back in the state cache."""
        self.cache.rollback(list(chains))

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copies the blocks in the KV cache."""
        assert self.kv_cache is not None
        self.kv_cache.copy_blocks(list(src), list(dst))
