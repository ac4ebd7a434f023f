"""The RMS norms of the Mamba family, all with statistics in float32.

- `RMSNorm`: the block and final norms (weight in the model dtype).
- `weightless_rms_norm`: FalconMamba's normalisation of the time step, B and C.
- `GatedRMSNorm`: Mamba2's norm of the scan output gated by `silu(z)`, per group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps)` over the last dimension, in float32, cast back to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """`weight * rmsnorm_per_group(x * silu(z))`, statistics over groups of `group_size`."""

    def __init__(self, hidden_size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """`x, z (T, I)` -> `(T, I)` in x's dtype (math in float32)."""
        gated = x.float() * F.silu(z.float())  # (T, I)
        groups = gated.view(*gated.shape[:-1], -1, self.group_size)  # (T, I / gs, gs)
        variance = groups.pow(2).mean(-1, keepdim=True)
        normed = (groups * torch.rsqrt(variance + self.variance_epsilon)).view_as(gated)
        return self.weight * normed.to(x.dtype)
