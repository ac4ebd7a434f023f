"""`UniProcExecutor`: the whole model in the engine's process (tensor_parallel_size 1)."""

from __future__ import annotations

from typing import Any

from vllm_mamba.config import EngineConfig
from vllm_mamba.distributed.parallel_state import SINGLE
from vllm_mamba.executor.base import Executor
from vllm_mamba.kv_cache import AttentionSpec, KVCache, KVCacheSizing
from vllm_mamba.mamba_cache import MambaCache, MambaStateShape
from vllm_mamba.model_loader import build_model


class UniProcExecutor(Executor):
    """Loads the model here; the runner calls it directly."""

    def __init__(self, config: EngineConfig) -> None:
        mc = config.model_config
        self.device = config.device
        self.tp = SINGLE
        self.model, _ = build_model(mc.path, mc.hf_config, mc.dtype, config.device)
        self.runner_model = self.model

    def make_state_cache(self, shape: MambaStateShape, num_slots: int) -> MambaCache:
        """The state cache of `num_slots` slots."""
        return MambaCache(shape, num_slots, self.device)

    def make_kv_cache(self, specs: list[AttentionSpec], sizing: KVCacheSizing) -> KVCache:
        """The KV cache, bound to the model's attention layers."""
        kv_cache = KVCache(specs, sizing, self.device)
        kv_cache.bind(self.model)
        return kv_cache

    def execute(self, runner: Any, step: Any) -> Any:
        """`runner.execute(step)`."""
        return runner.execute(step)
