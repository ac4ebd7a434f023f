"""Linear layers for the decode step: a memory-bound matrix-vector kernel for small batches.

At batch sizes up to `SMALL_BATCH` on the CPU, `linear` calls the C++ kernel
`vllm_mamba::linear_small_batch`, which streams the weight once at close to memory speed;
larger batches (compute-bound) and other devices use `torch.nn.functional.linear`. The choice
between them is made here and only here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.ops import cpu_kernels

SMALL_BATCH = 8
_HAS_KERNEL = cpu_kernels.available() and hasattr(torch.ops.vllm_mamba, "linear_small_batch")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x (B, K) @ weight (N, K)^T + bias` -> `(B, N)`, by the fastest path for the shape."""
    if (
        _HAS_KERNEL
        and x.dim() == 2
        and x.shape[0] <= SMALL_BATCH
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.is_contiguous()
        and not torch.is_grad_enabled()
    ):
        return torch.ops.vllm_mamba.linear_small_batch(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and checkpoint names) that runs through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
