"""What every state-space mixer shares: the conv1d and SSM parameters, their derived tensors,
and the causal conv over a step's flat batch (`causal_conv`, also the Gated DeltaNet's). Its
state (bound by the state cache) is `conv (S, CD, K - 1)` and `ssm`, whose shape each mixer
declares in its `state_spec`.

Glossary: T tokens in the step, CD conv channels, K conv kernel width. `A_log` is `(I, N)` for
Mamba and `(NH,)` for Mamba2; `D` has one entry per channel (Mamba) or head (Mamba2).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.ops.table import MambaOps


class Conv1dWeights(nn.Module):
    """Holds the depthwise conv parameters under the checkpoint's names (`weight (CD, 1, K)`)."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None


class StateSpaceMixer(StatefulLayer):
    """Base of the Mamba and Mamba2 mixers: `conv1d`, `A_log`, `D`, and the ops table.

    `fused_decode` says whether the mixer's decode-only steps may run as one fused kernel call
    (`fused_decode_layer`, read when the layer's decode plan is made); a subclass that changes
    the mixer's math sets it False.
    """

    fused_decode: bool = True

    def __init__(
        self,
        conv_channels: int,
        conv_kernel: int,
        use_conv_bias: bool,
        a_log_shape: tuple[int, ...],
        ops: MambaOps,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.conv1d = Conv1dWeights(conv_channels, conv_kernel, use_conv_bias)
        self.A_log = nn.Parameter(torch.empty(a_log_shape))
        self.D = nn.Parameter(torch.empty(a_log_shape[0]))
        self.register_buffer("A", torch.empty(0), persistent=False)
        self.register_buffer("conv_weight", torch.empty(0), persistent=False)

    def process_weights_after_loading(self) -> None:
        """Precomputes `A = -exp(A_log)` in float32 and the `(CD, K)` conv filters."""
        self.A = -torch.exp(self.A_log.detach().float())
        self.conv_weight = self.conv1d.weight.detach()[:, 0, :].contiguous()

    def conv(self, x: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """Causal conv + SiLU of `x (T, CD)` over `self.state["conv"]` (see `causal_conv`)."""
        return causal_conv(
            self.ops, x, self.conv_weight, self.conv1d.bias, self.state["conv"], meta
        )


def causal_conv(
    ops: MambaOps,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    meta: MambaMetadata,
    activation: bool = True,
) -> torch.Tensor:
    """Causal depthwise conv (+ SiLU) of a step's `x (T, CD)`: decode rows by the one-token
    update, prefill chunks by the varlen conv (from their saved history when they have one).

    Args:
        weight: `(CD, K)` filters; bias: `(CD,)` or None.
        conv_states: `(S, CD, K - 1)` over all slots, advanced in place.
        activation: apply the SiLU (False: the conv alone, LFM2's short conv).

    Returns:
        `(T, CD)` in x's dtype.
    """
    return recurrent_step(
        meta, [conv_states],
        decode=lambda rows, slots: ops.causal_conv1d_update(
            x=x[rows], conv_states=conv_states, weight=weight, bias=bias, state_indices=slots,
            activation=activation,
        ),
        prefill=lambda rows: ops.causal_conv1d_varlen(
            x=x[rows], weight=weight, bias=bias, conv_states=conv_states,
            query_start_loc=meta.prefill_query_start_loc,
            state_indices=meta.prefill_state_indices,
            has_initial_state=meta.prefill_has_initial_state, activation=activation,
        ),
    )  # fmt: skip
