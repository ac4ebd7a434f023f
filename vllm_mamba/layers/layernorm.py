"""The RMS norms of the Mamba family, all with statistics in float32.

- `RMSNorm`: the block and final norms (weight in the model dtype).
- `ZeroCenteredRMSNorm`: Qwen3.5's and Qwen3-Next's norms, scaled by `1 + weight` in float32.
- `weightless_rms_norm`: FalconMamba's normalisation of the time step, B and C.
- `GatedRMSNorm`: Mamba2's norm of the scan output gated by `silu(z)`, per group.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.ops.table import MambaOps


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, computed in float32 and cast back to x's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises the last dimension of `x (..., hidden)`."""
        input_dtype = x.dtype
        xf = x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)
        return self.weight * (xf * torch.rsqrt(variance + self.variance_epsilon)).to(input_dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """`x / sqrt(mean(x^2) + eps) * (1 + weight)`, all in float32, cast back to x's dtype (the
    checkpoints store `weight` centred on zero)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises the last dimension of `x (..., hidden)`."""
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps)` over the last dimension, in float32, cast back to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """`weight * rmsnorm_per_group(x * silu(z))`, statistics over groups of `group_size`.

    Runs the ops table's `gated_rms_norm` (see `vllm_mamba.ops.gated_rms_norm`).
    """

    def __init__(self, hidden_size: int, group_size: int, eps: float, ops: MambaOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.variance_epsilon = eps
        self.norm_op = ops.gated_rms_norm

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """`x, z (T, I)` -> `(T, I)` in x's dtype (math in float32)."""
        return self.norm_op(
            x=x, z=z, weight=self.weight, group_size=self.group_size, eps=self.variance_epsilon
        )
