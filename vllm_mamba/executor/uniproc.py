"""`UniProcExecutor`: the whole model in the engine's process (tensor_parallel_size 1)."""

from __future__ import annotations

from typing import Any

from vllm_mamba.config import EngineConfig
from vllm_mamba.distributed.parallel_state import SINGLE
from vllm_mamba.engine.model_runner import StepResult
from vllm_mamba.executor.base import Executor, make_caches
from vllm_mamba.kv_cache import KVCacheSizing
from vllm_mamba.model_loader import build_model


class UniProcExecutor(Executor):
    """Loads the model here; the runner calls it directly."""

    def __init__(self, config: EngineConfig) -> None:
        mc = config.model_config
        self.config = config
        self.device = config.device
        self.tp = SINGLE
        self.model, _ = build_model(
            mc.path, mc.hf_config, mc.dtype, config.device, mtp=config.uses_mtp
        )
        self.runner_model = self.model

    def init_caches(self, num_slots: int, sizing: KVCacheSizing | None) -> None:
        """The state cache of `num_slots` slots and the KV cache, bound to the model."""
        self.cache, self.kv_cache = make_caches(
            self.model, self.config, num_slots, sizing, self.device
        )

    def execute(self, step: Any) -> StepResult:
        """`runner.execute(step)`."""
        return self.runner.execute(step)
