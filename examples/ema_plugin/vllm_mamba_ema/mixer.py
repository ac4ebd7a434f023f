"""`EmaMixer`: a toy recurrent mixer with a state of its own shape, written against the engine's
plugin API (`StatefulLayer`, `StateSpec`, `MambaMetadata`, `recurrent_step`).

    u, z = in_proj(x).chunk(2)                            # (T, C) each
    m_t  = ema_t(u) + w1 * u_{t-1} + w2 * u_{t-2}         # see `vllm_mamba_ema.ops`
    y    = out_proj(m * silu(z))                          # (T, H)

State per sequence: `ema (C,)` (recurrent, float32) and `last (2, C)` (conv, model dtype).
Glossary: T tokens in the step, H hidden size, C EMA channels, S state slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.ops.table import MambaOps
from vllm_mamba_ema.ops import OP_FAMILY


class EmaMixer(StatefulLayer):
    """Per-channel exponential moving average with two lag taps, gated by `silu(z)`."""

    def __init__(self, hidden_size: int, ema_size: int, ops: MambaOps) -> None:
        super().__init__()
        self.ema_size = ema_size
        self.kernels = ops.family(OP_FAMILY)  # this backend's EMA ops, else the `_ref`s
        self.in_proj = Linear(hidden_size, 2 * ema_size, False, ops)
        self.decay = nn.Parameter(torch.empty(ema_size))  # a = sigmoid(decay)
        self.lag_weight = nn.Parameter(torch.empty(2, ema_size))  # w1, w2
        self.out_proj = Linear(ema_size, hidden_size, False, ops)

    def state_spec(self) -> StateSpec:
        """`ema (C,)` float32 and `last (2, C)` in the model dtype."""
        return StateSpec((
            StateTensor("ema", (self.ema_size,), "recurrent", torch.float32),
            StateTensor("last", (2, self.ema_size), "conv"),
        ))  # fmt: skip

    def forward(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """Mixes `hidden (T, H)` (decodes first, then prefill chunks) and advances the state.

        `recurrent_step` runs the decode rows (in speculative waves when chains verify
        drafts, each wave's states saved into the spare slots), then the prefill chunks.
        """
        u, z = self.in_proj(hidden).chunk(2, dim=-1)  # (T, C) each
        a = torch.sigmoid(self.decay.float())  # (C,)
        ema, last = self.state["ema"], self.state["last"]  # (S, C), (S, 2, C)
        m = recurrent_step(  # (T, C)
            meta, [ema, last],
            decode=lambda rows, slots: self.kernels.state_update(
                u[rows], a, self.lag_weight, ema, last, slots
            ),
            prefill=lambda rows: self.kernels.scan_varlen(
                u[rows], a, self.lag_weight, ema, last, meta.prefill_query_start_loc,
                meta.prefill_state_indices, meta.prefill_has_initial_state,
            ),
        )  # fmt: skip
        return self.out_proj(m * F.silu(z))
