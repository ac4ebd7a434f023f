"""`SoftcappedGatedMLP`: Inkling 2's expert, a SwiGLU whose linear factors are soft-capped.

    y = down(cap_g(g) * sigmoid(g) * cap_u(u))      g, u = gate_proj(x), up_proj(x)

with `cap(x) = c * tanh(x / c)` (`softcap`) and the product in float32, rounded once to the
model dtype before `down_proj`; the sigmoid sees the raw gate. The elementwise functions run
row by row (`layers.rowwise`), so a speculative chain's rows equal the tokens decoded alone.
Parameters and tensor parallelism are `layers.mlp.GatedMLP`'s.

Glossary: T tokens, H hidden size.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.rowwise import rowwise


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """`cap * tanh(x / cap)`."""
    return torch.tanh(x / cap) * cap


class SoftcappedGatedMLP(GatedMLP):
    """An expert `down(cap_g(g) * sigmoid(g) * cap_u(u))` (see the module docstring)."""

    def __init__(self, *args: Any, caps: tuple[float, float], **kwargs: Any) -> None:
        """Args: `GatedMLP`'s; `caps` the gate's and the up projection's caps."""
        super().__init__(*args, **kwargs)
        self.caps = caps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`."""
        gate, up = self.gate_proj(x).float(), self.up_proj(x).float()
        gate_cap, up_cap = self.caps
        gated = rowwise(lambda g: softcap(g, gate_cap) * torch.sigmoid(g), gate)
        inner = gated * rowwise(lambda u: softcap(u, up_cap), up)
        return self.down_proj(inner.to(x.dtype))
