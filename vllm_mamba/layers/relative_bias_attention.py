"""The relative-position bias of the Inkling families' attention: `RelativeLogits`, the bank of
bias profiles that turns each token's relative states into its bias table `rel (T, Hq, E)`,
and `log_scale`, the factor the full layers scale their queries and biases by past a position.

Each query token brings `rel (Hq, E)`: one bias value per head and backward distance
`d = p - j` in `[0, E)` (E the layer's bias extent) from the query at position p to the key
at position j; the bias is zero at `d >= E`. `PagedAttention` takes it (and Inkling 2's sink
logits) as the paged kernels' optional score terms (`vllm_mamba.ops.paged_attention`:
`_ref`, C++ and Triton), so the scores of head h are

    s[j] = scale * (q_h . k_j) + (rel[h, p - j] if p - j < E else 0)     for j in the window

Glossary: T tokens in the step, Hq query heads, E bias extent.
"""

from __future__ import annotations

import torch
from torch import nn


def log_scale(positions: torch.Tensor, n_floor: int, alpha: float) -> torch.Tensor:
    """`tau (T,)` float32 at positions `p`: `1 + alpha * log(max((p + 1) / n_floor, 1))`, the
    factor the full-attention layers of the Inkling families scale their queries and biases by
    past `n_floor`."""
    return 1.0 + alpha * torch.log(((positions + 1).float() / n_floor).clamp(min=1.0))


class RelativeLogits(nn.Module):
    """`proj (d_rel, E)`: a bank of bias-by-distance profiles that each token's relative
    states mix into its per-head bias table (transformers' `rel_logits_proj`)."""

    def __init__(self, d_rel: int, extent: int) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.empty(d_rel, extent))

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """`states (T, Hq, d_rel)` -> `rel (T, Hq, E)`."""
        return states @ self.proj
