"""What a worker rank (1..N-1) runs: its model shard and caches, driven by rank 0's commands.

Rank 0 (in the engine's process) sends one command per model call of a step, in order:

- `("init_caches", num_slots, sizing)`: at startup; the worker allocates the caches of its
  own shard's specs (`executor.base.make_caches`) and binds them to its layers.
- `("forward", input_ids, metadata)`: the step's flat batch (CPU tensors); the worker runs
  its shard, joining the layers' collectives, and advances its part of the state.
- `("logits", shape, dtype)`: rank 0 broadcasts the hidden rows to score; the worker scores
  its vocabulary rows (all-gathered; only rank 0 samples).
- `("copy_slots", src, dst)`, `("copy_blocks", src, dst)`: forks and snapshots of state
  slots, copy-on-write of KV blocks.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from vllm_mamba.config import EngineConfig
from vllm_mamba.distributed.communication import broadcast
from vllm_mamba.distributed.parallel_state import TensorParallel, init_tensor_parallel
from vllm_mamba.engine.cpu_threads import default_threads, set_cpu_threads
from vllm_mamba.executor.base import make_caches
from vllm_mamba.kv_cache import KVCache
from vllm_mamba.mamba_cache import MambaCache
from vllm_mamba.model_loader import build_model
from vllm_mamba.ops.cpu_kernels import flush_denormals

Command = tuple[Any, ...]


def metadata_to(meta: Any, device: torch.device) -> Any:
    """A copy of a step-metadata dataclass with every tensor field on `device`."""
    moved = copy.copy(meta)
    for f in dataclasses.fields(meta):
        value = getattr(meta, f.name)
        if isinstance(value, torch.Tensor):
            setattr(moved, f.name, value.to(device))
    return moved


class Worker:
    """One worker rank: joins the group, loads its shard, then runs `handle` per command."""

    def __init__(
        self, config: EngineConfig, tp: TensorParallel, init_method: str, device: torch.device
    ) -> None:
        if device.type == "cpu":
            set_cpu_threads(config.cpu_threads or default_threads(config.ranks_per_machine()))
            flush_denormals()  # as the engine does for rank 0
        self.device = device
        self.config = config
        self.tp = tp
        init_tensor_parallel(tp, init_method, device)
        mc = config.model_config
        self.model, _ = build_model(mc.path, mc.hf_config, mc.dtype, device, tp)
        self.cache: MambaCache | None = None
        self.kv_cache: KVCache | None = None

    @torch.inference_mode()
    def handle(self, command: Command) -> None:
        """Runs one command of rank 0 (see the module docstring)."""
        kind = command[0]
        if kind == "forward":
            _, input_ids, meta = command
            assert self.cache is not None
            self.model(input_ids.to(self.device), metadata_to(meta, self.device))
        elif kind == "logits":
            _, shape, dtype = command
            hidden = broadcast(torch.empty(shape, dtype=dtype, device=self.device), self.tp)
            self.model.compute_logits(hidden)
        elif kind == "copy_slots":
            assert self.cache is not None
            self.cache.copy_slots(command[1], command[2])
        elif kind == "copy_blocks":
            assert self.kv_cache is not None
            self.kv_cache.copy_blocks(command[1], command[2])
        elif kind == "init_caches":
            self.cache, self.kv_cache = make_caches(
                self.model, self.config, command[1], command[2], self.device
            )
        else:
            raise ValueError(f"unknown worker command {kind!r}")
