"""`BlockAttentionResidual`: attention over depth (Inkling 2's block attention residuals).

A model of this kind keeps, per token, the hidden states that entered each completed block of
layers (`block_states (T, B, H)`, the embeddings' block first) beside the running partial sum of
the current block. A layer's input is not that partial sum but a softmax mix of all of them,
read with learned queries `query (Q, H)` (one mix per query: Q = 1, or 3 for the separate
query, key and value inputs of a full-attention layer):

    s = rms_norm([block_states | partial])          # (T, B + 1, H), weightless, eps 1e-6
    out_q = softmax(query_q . s / sqrt(H)) @ s       # (T, H) per query, float32

Everything is per token, so there is no state across steps: the blocks live within one
forward. Checkpoint tensor: `query (H,)` or `(Q, H)`, float32 in transformers.

Glossary: T tokens, B completed blocks, H hidden size, Q queries.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.layers.layernorm import weightless_rms_norm

NORM_EPS = 1e-6  # transformers' `Inkling2UnweightedRMSNorm()` default


class BlockAttentionResidual(nn.Module):
    """Learned queries over the block states and the partial block (see the module
    docstring)."""

    def __init__(self, hidden_size: int, num_queries: int = 1) -> None:
        super().__init__()
        shape = (hidden_size,) if num_queries == 1 else (num_queries, hidden_size)
        self.query = nn.Parameter(torch.empty(shape))

    def forward(self, block_states: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        """`block_states (T, B, H)`, `partial (T, H)` -> `(Q, T, H)` float32."""
        return depth_mix(self.query.view(-1, self.query.shape[-1]), block_states, partial)


def depth_mix(
    query: torch.Tensor, block_states: torch.Tensor, partial: torch.Tensor
) -> torch.Tensor:
    """The softmax mixes of `query (Q, H)` over `block_states (T, B, H)` and `partial (T, H)`,
    each normed: `(Q, T, H)` float32 (see the module docstring).

    The dot products and the mix are elementwise products summed in a fixed order per token
    (over H, then over the blocks in order), not matrix products, whose sums would depend on
    the number of tokens: a speculative chain's rows get the bits of the tokens decoded one by
    one."""
    stacked = torch.cat([block_states, partial[:, None]], dim=1).float()  # (T, B + 1, H)
    stacked = weightless_rms_norm(stacked, NORM_EPS)
    hidden = stacked.shape[-1]
    query = query.float()[:, None, :]  # (Q, 1, H)
    scores = torch.stack(
        [(stacked[:, b] * query).sum(dim=-1) for b in range(stacked.shape[1])], dim=-1
    )  # (Q, T, B + 1)
    weights = (scores * hidden**-0.5).softmax(dim=-1)
    out = weights[..., 0, None] * stacked[:, 0]  # (Q, T, H)
    for b in range(1, stacked.shape[1]):
        out += weights[..., b, None] * stacked[:, b]
    return out
