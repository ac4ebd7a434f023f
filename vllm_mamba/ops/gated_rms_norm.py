"""Mamba2's gated RMSNorm: `weight * rmsnorm_per_group(x * silu(z))`, as an op of the table.

The pure-PyTorch reference `gated_rms_norm_ref`; the C++ kernel (`csrc/gated_rms_norm.cpp`)
does the same in one pass per row and is chosen in `vllm_mamba.ops.dispatch`.

Glossary: T tokens, I channels (`NH * P`), G groups of `I / G` channels each with its own
statistics (Mamba2's `n_groups`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from vllm_mamba.ops.families import OpFamily, OpSpec

Tensor = torch.Tensor


def gated_rms_norm_ref(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """Gates `x` by `silu(z)`, RMS-normalises each group of channels, scales by `weight`.

    Args:
        x: `(T, I)` the scan output.
        z: `(T, I)` the gate (a view with a free row stride is fine).
        weight: `(I,)` in the model dtype.
        group_size: channels per normalisation group (`I / G`).
        eps: added to the mean square.

    Returns:
        `(T, I)` in x's dtype; the statistics are float32 and the normalised value is cast to
        x's dtype before the weight multiplies it.
    """
    gated = x.float() * F.silu(z.float())  # (T, I)
    groups = gated.view(*gated.shape[:-1], -1, group_size)  # (T, G, I / G)
    variance = groups.pow(2).mean(-1, keepdim=True)
    normed = (groups * torch.rsqrt(variance + eps)).view_as(gated)
    return weight * normed.to(x.dtype)


class GatedRMSNormOp(Protocol):
    def __call__(
        self, x: Tensor, z: Tensor, weight: Tensor, group_size: int, eps: float,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    "gated_rms_norm",
    {
        "gated_rms_norm": OpSpec(GatedRMSNormOp, gated_rms_norm_ref),
    },
)
