"""The collectives of tensor-parallel layers, over the default process group.

Each takes the layer's `TensorParallel` and is the identity when `tp.size == 1`, so a model
built for one rank never touches torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vllm_mamba.distributed.parallel_state import TensorParallel


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The sum of `x` over the ranks (in place; returns `x`).

    bfloat16 is summed in float32 (gloo has no bfloat16 sum on every build, and float32 keeps
    the partial sums as exact as one rank's product).
    """
    if tp.size == 1:
        return x
    if x.dtype in (torch.bfloat16, torch.float16):
        acc = x.float()
        dist.all_reduce(acc)
        return x.copy_(acc)
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, tp: TensorParallel, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (same shape on every rank)."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


def broadcast(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Rank 0's `x` on every rank (in place; `x` must have the same shape everywhere)."""
    if tp.size > 1:
        dist.broadcast(x, src=0)
    return x


def all_reduce_max(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The elementwise maximum of `x` over the ranks (in place; returns `x`)."""
    if tp.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x
