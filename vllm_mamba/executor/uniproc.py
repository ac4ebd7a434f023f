"""`UniProcExecutor`: the whole model in the engine's process (tensor_parallel_size 1), one
`Worker` of one rank."""

from __future__ import annotations

from vllm_mamba.config import EngineConfig
from vllm_mamba.distributed.parallel_state import SINGLE
from vllm_mamba.executor.base import Executor
from vllm_mamba.kv_cache import KVCacheSizing
from vllm_mamba.worker.step import Step, StepResult
from vllm_mamba.worker.worker import Worker


class UniProcExecutor(Executor):
    """Rank 0's worker, in this process, is the only one."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device
        self.tp = SINGLE
        self.worker = Worker(config, self.tp, self.device)  # loads the model

    def init_caches(self, num_slots: int, sizing: KVCacheSizing | None) -> None:
        """The state cache of `num_slots` slots and the KV cache, bound to the model."""
        self.worker.init_caches(num_slots, sizing)

    def execute(self, step: Step) -> StepResult:
        """The worker's step."""
        return self.worker.execute(step)
