"""Which tensor-parallel rank this process is, and the torch.distributed group it belongs to.

A model is built with a `TensorParallel` (`rank`, `size`): the sharded layers size their
parameters and pick their slices from it. `SINGLE` (rank 0 of 1) is the default everywhere
and makes every sharded layer the plain layer. `init_tensor_parallel` joins the process group
of an engine's ranks (gloo on the CPU, NCCL on CUDA) and makes it the one the collectives use.

The group is the process's default group, so one tensor-parallel engine at a time may hold it.
Each join starts a new generation (`group_generation`); an engine dropped without `shutdown`
leaves the group from its finalizer with its own generation, which never destroys a newer
engine's group. A join that finds a group still held first collects garbage (running the
finalizers of engines nothing refers to any more), and if a live engine still holds it,
says so.
"""

from __future__ import annotations

import datetime
import gc
import urllib.parse
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vllm_mamba import envs

_generation = 0


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place among the `size` ranks that share each layer."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` items split evenly.

        Raises:
            ValueError: `total` is not a multiple of the size (naming `what`).
        """
        if total % self.size:
            raise ValueError(
                f"{what} ({total}) must be a multiple of tensor_parallel_size ({self.size})"
            )
        return total // self.size

    def range(self, total: int, what: str) -> tuple[int, int]:
        """`(start, length)` of this rank's even share of `total` items."""
        part = self.split(total, what)
        return self.rank * part, part


SINGLE = TensorParallel()


def collective_timeout_s() -> float:
    """How long a collective waits for a missing rank (`VLLM_MAMBA_DIST_TIMEOUT_S`)."""
    return envs.VLLM_MAMBA_DIST_TIMEOUT_S


def open_rendezvous(host: str, size: int) -> tuple[dist.TCPStore, str]:
    """Rank 0's rendezvous for a group of `size` ranks: a store listening on `host` at a port
    the kernel chose (bound, not probed, so no other process can take it in between), and
    the `tcp://host:port` address the other ranks join at."""
    store = dist.TCPStore(
        host,
        0,
        world_size=size,
        is_master=True,
        timeout=datetime.timedelta(seconds=collective_timeout_s()),
        wait_for_workers=False,
    )
    return store, f"tcp://{host}:{store.port}"


def _rendezvous_client(init_method: str, size: int) -> dist.TCPStore:
    """A client of the rendezvous store at `init_method` (`tcp://host:port`)."""
    address = urllib.parse.urlsplit(init_method)
    if address.scheme != "tcp" or not address.hostname or not address.port:
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    return dist.TCPStore(
        address.hostname,
        address.port,
        world_size=size,
        is_master=False,
        timeout=datetime.timedelta(seconds=collective_timeout_s()),
    )


def init_tensor_parallel(
    tp: TensorParallel,
    init_method: str,
    device: torch.device,
    store: dist.Store | None = None,
) -> None:
    """Joins the group of `tp.size` ranks at `init_method` (a `tcp://host:port` address: a
    client of rank 0's rendezvous store), or through `store` (rank 0's own, from
    `open_rendezvous`) when given.

    Gloo on the CPU, NCCL on CUDA (each rank on `cuda:rank` of its machine); a collective
    that waits longer than `collective_timeout_s()` for a rank raises.
    """
    global _generation
    if dist.is_initialized():
        gc.collect()  # an engine dropped without shutdown leaves the group when collected
    if dist.is_initialized():
        raise RuntimeError(
            "another tensor-parallel engine in this process still holds the process group: "
            "call its shutdown() (or use `with LLM(...) as llm:`) before starting a new one"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        store=store if store is not None else _rendezvous_client(init_method, tp.size),
        rank=tp.rank,
        world_size=tp.size,
        timeout=datetime.timedelta(seconds=collective_timeout_s()),
    )
    _generation += 1


def group_generation() -> int:
    """The generation of the group joined last (0 before any)."""
    return _generation


def destroy_tensor_parallel(generation: int | None = None) -> None:
    """Leaves the process group, if this process is in one (and, when `generation` is given,
    only if the group is still that generation's)."""
    if generation is not None and generation != _generation:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
