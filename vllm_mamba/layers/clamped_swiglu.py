"""`ClampedGatedMLP`: a SwiGLU whose factors are clipped after the activation (Ling 3's routed
and shared experts, transformers' `Step3p7` experts with `limit_after_act`) or before it
(`before_act`: GLM-5-Next's MLPs and experts).

    y = down(min(act(g), limit) * clamp(u, -limit, limit))      g, u = gate_proj(x), up_proj(x)
    y = down(act(min(g, limit)) * clamp(u, -limit, limit))      (before_act)

in the model dtype, as transformers. A layer whose limit is zero is not clipped and is built as
a plain `GatedMLP`; this class is only for a positive limit. The fused `mlp_decode` /
`moe_decode` kernels take the clip (`layers.mlp.swiglu_clip`). The
elementwise part runs row by row (`layers.rowwise`), so a speculative chain's rows equal the
tokens decoded alone. Parameters and tensor parallelism are `layers.mlp.GatedMLP`'s.

Glossary: T tokens, H hidden size.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.rowwise import rowwise


class ClampedGatedMLP(GatedMLP):
    """`down(min(act(g), limit) * clamp(u, -limit, limit))` (see the module docstring)."""

    kernel_clips = True  # the `ffn` kernels compute it (`layers.mlp.kernel_computes`)

    def __init__(self, *args: Any, limit: float, before_act: bool = False, **kwargs: Any) -> None:
        """Args: `GatedMLP`'s; `limit` the clip (positive); `before_act` clips the gate before
        the activation instead of after it.

        Raises:
            ValueError: `limit` is not positive.
        """
        if not limit > 0:
            raise ValueError(f"a SwiGLU clip limit must be positive, got {limit}")
        super().__init__(*args, **kwargs)
        self.limit = float(limit)
        self.before_act = before_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`."""
        limit = self.limit
        if self.before_act:
            gate = rowwise(lambda g: self.act(g.clamp(max=limit)), self.gate_proj(x))
        else:
            gate = rowwise(lambda g: self.act(g).clamp(max=limit), self.gate_proj(x))
        return self.down_proj(gate * self.up_proj(x).clamp(min=-limit, max=limit))


def gated_mlp(
    *args: Any, limit: float | None = None, before_act: bool = False, **kwargs: Any
) -> GatedMLP:
    """A `GatedMLP`, or a `ClampedGatedMLP` where `limit` is set and not zero (a zero limit
    disables the clip, as in the checkpoints' per-layer lists), clipping the gate `before_act`
    or after."""
    if limit:
        return ClampedGatedMLP(*args, limit=limit, before_act=before_act, **kwargs)
    return GatedMLP(*args, **kwargs)
