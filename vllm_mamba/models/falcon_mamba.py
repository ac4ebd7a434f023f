"""FalconMamba (`FalconMambaForCausalLM`, the `tiiuae/falcon-mamba-*` checkpoints).

FalconMamba is Mamba with one change in the mixer: the time step, B and C that `x_proj`
produces are each RMS-normalised (no weight, epsilon `mixer_rms_eps`) before the scan. The
checkpoints carry the same tensors as Mamba's, so the model is Mamba's with `x_proj` replaced
by `NormedXProj`; everything else (blocks, state shapes, loading) is shared.

Glossary: T tokens, I intermediate size, R time-step rank, N state size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.models.mamba import MambaForCausalLM
from vllm_mamba.ops.dispatch import MambaOps


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps)` over the last dimension, in float32, cast back to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class NormedXProj(nn.Linear):
    """Mamba's `x_proj` (`weight (R + 2N, I)`) with its three outputs RMS-normalised."""

    def __init__(self, intermediate_size: int, time_step_rank: int, state_size: int, eps: float):
        super().__init__(intermediate_size, time_step_rank + 2 * state_size, bias=False)
        self.split_sizes = [time_step_rank, state_size, state_size]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, I)` -> `(T, R + 2N)`: the time step, B and C, each normalised."""
        parts = F.linear(x, self.weight).split(self.split_sizes, dim=-1)
        return torch.cat([weightless_rms_norm(p, self.eps) for p in parts], dim=-1)


class FalconMambaForCausalLM(MambaForCausalLM):
    """FalconMamba language model: Mamba whose mixers normalise dt, B and C."""

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__(config, ops)
        for layer in self.backbone.layers:
            mixer = layer.mixer
            mixer.x_proj = NormedXProj(
                config.intermediate_size,
                mixer.time_step_rank,
                mixer.state_size,
                eps=config.mixer_rms_eps,
            )
