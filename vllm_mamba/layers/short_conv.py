"""`ShortConv`: LFM2's gated short convolution over one flat varlen batch (decodes first, then
prefill chunks).

    B, C, x = in_proj(h).chunk(3)        # (T, D) each, in this order
    y = conv(B * x)                      # depthwise causal conv of width K, no activation
    out = out_proj(C * y)                # (T, H)

`conv` is depthwise (one filter of K taps per channel), causal, with an optional bias, and
starts from each sequence's saved history: the per-sequence state is that history alone,
`conv (D, K - 1)` (the last K - 1 values of `B * x`, kind `conv`, kept in the model dtype).
The gating and the conv run as one op on the in_proj output, the op family `short_conv`
(`vllm_mamba.ops.short_conv`: `update` for the decode rows, `varlen` for the prefill chunks;
float32 math, one rounding of `C * y`).
There is no recurrent state, so forks, preemption and prefix snapshots copy this one tensor.
In the checkpoints: `in_proj.weight (3D, H)`, `conv.weight (D, 1, K)`, `out_proj.weight
(H, D)`; LFM2's `conv_bias` gives all three a bias (`(3D,)`, `(D,)`, `(H,)`).

Tensor parallelism (`tp`): each rank holds D/N channels: its rows of each of B, C and x in
`in_proj` (column-parallel by sections), its conv filters and state, and its input columns of
`out_proj` (row-parallel, all-reduced); the gating is per channel, so no other communication.

Glossary: T tokens in the step, H hidden size, D conv channels (H in LFM2; this rank's D/N under
tensor parallelism), K conv width (`conv_L_cache`), S state slots, N ranks.
"""

from __future__ import annotations

import torch

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.mixer_base import Conv1dWeights
from vllm_mamba.layers.parallel_linear import column_linear, row_linear, shard_param
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.ops import short_conv as short_conv_ops
from vllm_mamba.ops.table import MambaOps


class ShortConv(StatefulLayer):
    """`out_proj(C * conv(B * x))` with `B, C, x = in_proj(h)` (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        channels: int,
        kernel: int,
        bias: bool,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """Args: `channels` D (global), `kernel` K, `bias` whether `in_proj`, `conv` and
        `out_proj` have biases."""
        super().__init__()
        if kernel < 2:
            raise ValueError(f"conv_L_cache ({kernel}) must be at least 2")
        start, local = tp.range(channels, "the short conv's channels (hidden_size)")
        self.ops = ops
        self.sc = ops.family(short_conv_ops.FAMILY)  # the fused gated conv ops
        self.channels = local  # this rank's D
        self.kernel = kernel
        self.in_proj = column_linear(hidden_size, [channels] * 3, bias, ops, tp)
        self.conv = Conv1dWeights(local, kernel, bias)
        self.out_proj = row_linear(channels, hidden_size, bias, ops, tp)
        if tp.size > 1:
            shard_param(self.conv, "weight", 0, [(start, local)], channels)
            if bias:
                shard_param(self.conv, "bias", 0, [(start, local)], channels)
        self.register_buffer("conv_weight", torch.empty(0), persistent=False)

    def process_weights_after_loading(self) -> None:
        """Precomputes the `(D, K)` conv filters."""
        self.conv_weight = self.conv.weight.detach()[:, 0, :].contiguous()

    def state_spec(self) -> StateSpec:
        """One tensor: the conv history `(D, K - 1)` (the model dtype)."""
        return StateSpec((StateTensor("conv", (self.channels, self.kernel - 1), "conv"),))

    def forward(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """Mixes `hidden (T, H)` and advances each sequence's `self.state["conv"]`
        (`(S, D, K - 1)`) in place.

        Returns:
            `(T, H)` in the model dtype.
        """
        bcx = self.in_proj(hidden)  # (T, 3D): [B | C | x]
        conv_states = self.state["conv"]  # (S, D, K - 1)
        gated = recurrent_step(  # (T, D): C * conv(B * x)
            meta, [conv_states],
            decode=lambda r, slots: self.sc.update(
                bcx[r], conv_states, self.conv_weight, self.conv.bias, slots
            ),
            prefill=lambda r: self.sc.varlen(
                bcx[r], conv_states, self.conv_weight, self.conv.bias,
                meta.prefill_query_start_loc, meta.prefill_state_indices,
                meta.prefill_has_initial_state,
            ),
        )  # fmt: skip
        return self.out_proj(gated)  # (T, H)
