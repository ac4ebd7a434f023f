"""The messages between the passes of a looped block of layers (Inkling 2 Loop).

A looped model runs its layers `[start, end)` several times per step over the same tokens.
Pass p > 0 restarts from the hidden and block states that entered the loop, and each looped
layer j reads four messages from pass p - 1, one per input (query, key, value, MLP):

    messages_j = depth_mix(queries_j (4, H), blocks of pass p - 1 (its first left out), h)

(`layers.block_attention_residual.depth_mix`), each mixed into its input by a low-rank gate:

    g = down_proj([rms(x) | rms(m)])                     # (rank,)
    x' = (1 - tanh(forget_gate_proj(g))) * x + tanh(message_gate_proj(g)) * m      # float32

Checkpoint names: the queries as two `(2L, H)` tensors, `queries` (each loop layer's query and
MLP queries) and `kv_queries` (its key and value queries); a gate's `down_proj (rank, 2H)`,
`forget_gate_proj` and `message_gate_proj (H, rank)` (float32 in transformers; here in the
model dtype). Everything here is per token and replicated under tensor parallelism.

Glossary: T tokens, H hidden size, L looped layers, B blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.layers.block_attention_residual import depth_mix
from vllm_mamba.layers.layernorm import weightless_rms_norm
from vllm_mamba.layers.linear import Linear
from vllm_mamba.ops.table import MambaOps


class MessageInput(nn.Module):
    """`queries`, `kv_queries (2L, H)`: each looped layer's four message queries."""

    def __init__(self, hidden_size: int, loop_layers: int) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.empty(2 * loop_layers, hidden_size))
        self.kv_queries = nn.Parameter(torch.empty(2 * loop_layers, hidden_size))

    def forward(self, blocks: torch.Tensor, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        """Looped layer `layer`'s messages from the previous pass's `blocks (T, B, H)` and last
        `hidden (T, H)`: `(4, T, H)` float32 (query, key, value, MLP)."""
        pair = slice(2 * layer, 2 * layer + 2)
        q_mlp, kv = self.queries[pair], self.kv_queries[pair]
        query = torch.cat([q_mlp[:1], kv, q_mlp[1:]])  # (4, H)
        return depth_mix(query, blocks, hidden)


class MessageGate(nn.Module):
    """Mixes a message into an input through a low-rank gate (see the module docstring)."""

    def __init__(self, hidden_size: int, rank: int, eps: float, ops: MambaOps) -> None:
        super().__init__()
        self.eps = eps
        self.down_proj = Linear(2 * hidden_size, rank, False, ops)
        self.forget_gate_proj = Linear(rank, hidden_size, False, ops)
        self.message_gate_proj = Linear(rank, hidden_size, False, ops)

    def forward(self, x: torch.Tensor, message: torch.Tensor) -> torch.Tensor:
        """`x`, `message (T, H)` -> `(T, H)` float32."""
        x, message = x.float(), message.float()
        both = torch.cat(
            [weightless_rms_norm(x, self.eps), weightless_rms_norm(message, self.eps)], -1
        )
        g = self.down_proj(both.to(self.down_proj.compute_dtype))
        forget = torch.tanh(self.forget_gate_proj(g).float())
        keep = torch.tanh(self.message_gate_proj(g).float())
        return (1 - forget) * x + keep * message
