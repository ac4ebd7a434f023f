"""`Worker`: what runs the model on one rank, built the same way on every rank.

Every rank, in the engine's process (rank 0) or in a worker process or Ray actor (ranks
1..N-1), constructs one `Worker`, which in order:

1. sets the process up (`platform.Platform.setup`: threads, governor, denormals);
2. joins the tensor-parallel group (with more than one rank; the executor says how);
3. loads its shard of the model (the whole model with one rank; the MTP head when the
   speculative method is `mtp`).

Then the executor sizes the caches from rank 0's specs and calls `init_caches` on every rank
(`caches.make_caches`: each rank allocates from its own shard's specs), and `init_runner` on
rank 0, which builds the `ModelRunner` configured once and for all (`RunnerConfig`), with the
attention backend of the built model and, on CUDA when the backend declares decode steps
capturable and the model is not sharded, the decode CUDA graphs. Rank 0 then runs each step
(`execute`: a plain-data `step.Step` in, a `step.StepResult` out; the per-sequence state the
runner keeps, its sampling generators, lives here, keyed by sequence id). Under tensor
parallelism every rank does all of this the same way: rank 0's executor sends the other ranks
each call it makes on rank 0's worker (`init_caches`, `init_runner`, `execute` with the same
step; `handle`, see `relay`), so every rank runs the same runner code on the same data.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_mamba.attention.backend import AttentionBackend
from vllm_mamba.attention.selector import select_attention_backend
from vllm_mamba.config import EngineConfig
from vllm_mamba.distributed.parallel_state import TensorParallel, init_tensor_parallel
from vllm_mamba.kv_cache import KVCache, KVCacheSizing
from vllm_mamba.model_loader import build_model
from vllm_mamba.state_cache import StateCache
from vllm_mamba.worker.caches import (
    CacheCopies,
    CacheSpecs,
    LocalCopies,
    cache_specs_of,
    make_caches,
)
from vllm_mamba.worker.image_embeds import ImageEmbeddings
from vllm_mamba.worker.model_runner import ModelRunner, RunnerConfig
from vllm_mamba.worker.platform import Platform
from vllm_mamba.worker.relay import COMMANDS, Command
from vllm_mamba.worker.step import Step, StepResult

JoinGroup = Callable[[TensorParallel, torch.device], None]


def join_at(init_method: str) -> JoinGroup:
    """Joins the group at `init_method` (a `tcp://host:port` rendezvous)."""

    def join(tp: TensorParallel, device: torch.device) -> None:
        init_tensor_parallel(tp, init_method, device)

    return join


def captures_decode(
    backend: type[AttentionBackend], device: torch.device, tp_size: int, enforce_eager: bool
) -> bool:
    """Whether the runner captures decode CUDA graphs: on CUDA, when the backend declares its
    decode steps capturable, with one rank (a forward with collectives is not captured) and
    unless `enforce_eager`."""
    return (
        device.type == "cuda" and backend.decode_cuda_graphs and tp_size == 1 and not enforce_eager
    )


class Worker:
    """One rank: its platform setup, its shard, its caches and its runner.

    Args:
        config: the engine's configuration (the same on every rank).
        tp: this rank's place in the group.
        device: this rank's device.
        join: how this rank joins the group (required with more than one rank).
    """

    def __init__(
        self,
        config: EngineConfig,
        tp: TensorParallel,
        device: torch.device,
        join: JoinGroup | None = None,
    ) -> None:
        self.config = config
        self.tp = tp
        self.device = device
        self.platform = Platform.setup(config, device, runs_steps=tp.rank == 0)
        if tp.size > 1:
            assert join is not None, "a rank of a group needs a way to join it"
            join(tp, device)
        mc = config.model_config
        self.model, _ = build_model(
            mc.path,
            mc.hf_config,
            mc.dtype,
            device,
            tp,
            mtp=config.uses_mtp,
            images=config.multimodal is not None,
        )
        self.cache: StateCache | None = None
        self.kv_cache: KVCache | None = None
        self.copies: CacheCopies | None = None
        self.runner: ModelRunner | None = None

    def cache_specs(self) -> CacheSpecs:
        """This rank's cache specs (under tensor parallelism, its shard's)."""
        return cache_specs_of(self.model, self.config)

    def init_caches(self, num_slots: int, sizing: KVCacheSizing | None) -> None:
        """Allocates this rank's state cache of `num_slots` slots and its KV cache of
        `sizing` (None: none), and binds them to the shard's layers."""
        self.cache, self.kv_cache = make_caches(
            self.model, self.config, num_slots, sizing, self.device
        )
        self.copies = LocalCopies(self.cache, self.kv_cache)

    def init_runner(self, runner_config: RunnerConfig) -> ModelRunner:
        """Builds the runner over this rank's model and caches (after `init_caches`)."""
        assert self.cache is not None and self.copies is not None, "init_caches first"
        backend = select_attention_backend(has_kv_cache=self.kv_cache is not None)
        graphs = captures_decode(backend, self.device, self.tp.size, self.config.enforce_eager)
        self.runner = ModelRunner(
            self.model,
            self.cache,
            backend,
            self.device,
            runner_config,
            seed=self.config.model_config.seed,
            copies=self.copies,
            kv_cache=self.kv_cache,
            mtp=self.model.mtp if self.config.uses_mtp else None,
            cuda_graph_max_num_seqs=(self.config.scheduler_config.max_num_seqs if graphs else None),
            images=(
                ImageEmbeddings(self.model.encode_images)
                if getattr(self.model, "serves_images", False)
                else None
            ),
        )
        return self.runner

    def execute(self, step: Step) -> StepResult:
        """Runs one step (the governor, on rank 0, may first change the thread count)."""
        assert self.runner is not None, "init_runner first"
        self.platform.before_step()
        return self.runner.execute(step)

    # ----- ranks 1..N-1: rank 0's calls, as commands --------------------------------------
    def handle(self, command: Command) -> None:
        """Makes the call rank 0's executor made on rank 0's worker (see `relay`); a step's
        result stays here (rank 0's goes to the engine)."""
        kind = command[0]
        if kind not in COMMANDS:
            raise ValueError(f"unknown worker command {kind!r}")
        getattr(self, kind)(*command[1:])
