"""The one place where the implementation of the Mamba ops is chosen.

`get_mamba_ops(device)` returns a `MambaOps` table; layers call through it and never pick a
kernel themselves. `VLLM_MAMBA_OPS=ref` forces the pure-PyTorch references.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_mamba.ops.causal_conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from vllm_mamba.ops.selective_scan import selective_scan_varlen_ref, selective_state_update_ref


@dataclass(frozen=True)
class MambaOps:
    """The four kernels a Mamba mixer needs, with the signatures of the `_ref` functions."""

    name: str
    causal_conv1d_varlen: Callable[..., torch.Tensor]
    causal_conv1d_update: Callable[..., torch.Tensor]
    selective_scan_varlen: Callable[..., torch.Tensor]
    selective_state_update: Callable[..., torch.Tensor]


REF_OPS = MambaOps(
    name="ref",
    causal_conv1d_varlen=causal_conv1d_varlen_ref,
    causal_conv1d_update=causal_conv1d_update_ref,
    selective_scan_varlen=selective_scan_varlen_ref,
    selective_state_update=selective_state_update_ref,
)


def get_mamba_ops(device: torch.device | str) -> MambaOps:
    """Returns the fastest available ops for `device` (or the references when forced).

    Args:
        device: where the model runs.

    Returns:
        The ops table to call.
    """
    forced = os.environ.get("VLLM_MAMBA_OPS", "").strip().lower()
    if forced == "ref":
        return REF_OPS
    return REF_OPS
