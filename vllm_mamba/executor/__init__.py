"""What runs the model for the engine: one process, or one process (or Ray actor) per rank,
each rank a `worker.Worker`.

- `base.Executor`: the interface the engine uses (`execute(step)`, the caches, health).
- `uniproc.UniProcExecutor`: the model in the engine's process (tensor_parallel_size 1).
- `multiproc.MultiprocExecutor`: rank 0 in the engine's process, ranks 1..N-1 in worker
  processes on this machine (vLLM's `mp` backend).
- `ray_executor.RayExecutor`: ranks 1..N-1 as Ray actors, anywhere in a Ray cluster.
- `driver.DriverExecutor`: the base of the last two: rank 0's worker here, the others started
  by the subclass; the group's rendezvous, failures of a rank.
"""

from __future__ import annotations

from vllm_mamba.config import EngineConfig
from vllm_mamba.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    """The executor of `config.parallel_config` (starts the worker ranks and loads the model).

    Raises:
        ValueError: the architecture or its shapes do not allow tensor_parallel_size, or the
            backend is not available.
    """
    pc = config.parallel_config
    if pc.tensor_parallel_size == 1:
        from vllm_mamba.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)
    if pc.distributed_executor_backend == "ray":
        from vllm_mamba.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    from vllm_mamba.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)
