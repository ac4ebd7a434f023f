"""Rank 0's side of tensor parallelism inside the worker: every model call and cache copy of a
step is first sent to the other ranks, so that all ranks run the same step.

Rank 0's `Worker` is handed a `Send` (by its executor: the function that delivers a command to
ranks 1..N-1, in order) and gives its runner `RelayModel` and `RelayCopies` in place of the
model and `caches.LocalCopies`; the runner does not know the difference. The other ranks run
the same commands in `Worker.handle`:

- `("init_caches", num_slots, sizing)`: at startup; each rank allocates the caches of its own
  shard's specs (`caches.make_caches`) and binds them to its layers.
- `("forward", input_ids, metadata)`: the step's flat batch (CPU tensors); each rank runs its
  shard, joining the layers' collectives, and advances its part of the state.
- `("logits", shape, dtype)`: rank 0 broadcasts the hidden rows to score; each rank scores its
  vocabulary rows (all-gathered; only rank 0 samples).
- `("copy_slots", src, dst)`, `("copy_blocks", src, dst)`: forks and snapshots of state slots,
  copy-on-write of KV blocks.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from vllm_mamba.distributed.communication import broadcast
from vllm_mamba.distributed.parallel_state import TensorParallel
from vllm_mamba.worker.caches import CacheCopies

Command = tuple[Any, ...]
Send = Callable[[Command], None]
CPU = torch.device("cpu")


def metadata_to(meta: Any, device: torch.device) -> Any:
    """A copy of step metadata with every tensor on `device`, wherever it sits: a field, or
    inside a field's tuples, lists, dicts or nested dataclasses (`MambaMetadata.wave_copies`
    is a tuple of `(src, dst)` tensor pairs)."""
    if isinstance(meta, torch.Tensor):
        return meta.to(device)
    if isinstance(meta, tuple | list):
        return type(meta)(metadata_to(v, device) for v in meta)
    if isinstance(meta, dict):
        return {k: metadata_to(v, device) for k, v in meta.items()}
    if dataclasses.is_dataclass(meta) and not isinstance(meta, type):
        moved = copy.copy(meta)
        for f in dataclasses.fields(meta):
            value = getattr(meta, f.name)
            moved_value = metadata_to(value, device)
            if moved_value is not value:
                object.__setattr__(moved, f.name, moved_value)
        return moved
    return meta


class RelayModel:
    """Rank 0's model as the runner sees it: each call is sent to the other ranks first."""

    def __init__(self, model: nn.Module, send: Send, tp: TensorParallel) -> None:
        self.model = model
        self.send = send
        self.tp = tp

    def __call__(self, input_ids: torch.Tensor, meta: Any) -> torch.Tensor:
        """The step's forward on every rank; rank 0's hidden states `(T, H)`."""
        self.send(("forward", input_ids.to(CPU), metadata_to(meta, CPU)))
        return self.model(input_ids, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `(R, V)` of rows `hidden (R, H)`, each rank scoring its vocabulary rows."""
        hidden = hidden.contiguous()
        self.send(("logits", tuple(hidden.shape), hidden.dtype))
        broadcast(hidden, self.tp)
        return self.model.compute_logits(hidden)


class RelayCopies:
    """Rank 0's cache copies: sent to the other ranks, then made here."""

    def __init__(self, local: CacheCopies, send: Send) -> None:
        self.local = local
        self.send = send

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copies slots `src[i]` into `dst[i]` on every rank."""
        if src:
            self.send(("copy_slots", list(src), list(dst)))
        self.local.copy_slots(src, dst)

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copies KV blocks `src[i]` into `dst[i]` on every rank."""
        if src:
            self.send(("copy_blocks", list(src), list(dst)))
        self.local.copy_blocks(src, dst)
