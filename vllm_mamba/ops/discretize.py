"""The time-step discretisation shared by every scan reference (Mamba's and Mamba2's).

`dt` comes out of a projection; the scan uses `softplus(dt + dt_bias)`, optionally clamped to
`dt_limit` (Mamba2's `time_step_limit`), always in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def discretize_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float] | None = None,
) -> torch.Tensor:
    """`dt (..., C)` plus bias `(C,)`, softplus, then clamped to `dt_limit`, in float32.

    Args:
        dt: raw time steps, one per channel (Mamba) or head (Mamba2) in the last dimension.
        dt_bias: `(C,)` or None.
        dt_softplus: apply softplus after the bias.
        dt_limit: `(min, max)`; `(0, inf)` or None means no clamp.

    Returns:
        The float32 time steps, shaped like `dt`.
    """
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit is not None and (dt_limit[0] > 0.0 or dt_limit[1] != float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt
