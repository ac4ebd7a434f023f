"""`DynamicShortConv`: a depthwise causal conv whose taps are static per channel plus per-token
ones projected from another input, added to its own input (Inkling 2's convs over the keys and
values of its full-attention layers).

    w[t, c, l] = static_weight[l, c] + weight_proj(u_t)[head(c) * K + l]   # l: lag, 0 = now
    y[t, c] = (x[t, c] + sum_l w[t, c, l] * x[t - l, c]) / sqrt(2K + 1)    # float32

`x (T, C)` is what is convolved (a key or value projection), `u (T, H)` the input the per-token
taps come from (the projection's own input), shared by the `C / heads` channels of each
key/value head. Inputs before a sequence's first token are zeros. The per-sequence state is
the last K - 1 inputs, `conv (C, K - 1)` oldest first, float32, as `causal_conv1d`'s. The conv
itself is the `dynamic_conv` op family (`vllm_mamba.ops.dynamic_conv`: `_ref`, C++, Triton),
through `recurrent_step` (decode rows by their slots, prefill chunks from their saved
histories); the residual and the scale are applied here.

Tensor parallelism: this rank's key/value heads (`head_range`): their channels of
`static_weight`, their rows of `weight_proj`.

Glossary: T tokens in the step, H input width, C channels (this rank's), K conv width, S slots.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.parallel_linear import column_linear, shard_param
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.layers.residual_short_conv import pass_state_names
from vllm_mamba.ops import dynamic_conv
from vllm_mamba.ops.table import MambaOps


class DynamicShortConv(StatefulLayer):
    """`static_weight (K, C)` and `weight_proj (heads K, H)` (see the module docstring)."""

    def __init__(
        self,
        input_size: int,
        num_heads: int,
        head_dim: int,
        kernel: int,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
        head_range: tuple[int, int] | None = None,
        passes: int = 1,
    ) -> None:
        """Args: `num_heads` heads of `head_dim` channels over all ranks; `head_range` this
        rank's `(first, count)` (None: all); `passes` one history per pass of a looped layer
        (`residual_short_conv.pass_state_names`)."""
        super().__init__()
        first, count = head_range or (0, num_heads)
        self.kernel, self.num_heads, self.channels = kernel, count, count * head_dim
        self.static_weight = nn.Parameter(torch.empty(kernel, self.channels))
        rows = [(first * kernel, count * kernel)]
        self.weight_proj = column_linear(input_size, [num_heads * kernel], False, ops, tp, rows)
        if tp.size > 1:
            channels = [(first * head_dim, self.channels)]
            shard_param(self, "static_weight", 1, channels, num_heads * head_dim)
        self.divisor = math.sqrt(2 * kernel + 1)
        self.state_names = pass_state_names(passes)
        self.conv = ops.family(dynamic_conv.FAMILY)

    def state_spec(self) -> StateSpec:
        """The conv history `(C, K - 1)`, float32, of each pass."""
        shape = (self.channels, self.kernel - 1)
        return StateSpec(
            tuple(StateTensor(n, shape, "conv", torch.float32) for n in self.state_names)
        )

    def forward(
        self, x: torch.Tensor, u: torch.Tensor, meta: MambaMetadata, pass_index: int = 0
    ) -> torch.Tensor:
        """`x (T, C)`, `u (T, H)` -> `(T, C)` in x's dtype; the histories of pass
        `pass_index` advanced in place."""
        num_tokens = x.shape[0]
        taps = self.weight_proj(u).float().view(num_tokens, self.num_heads, self.kernel)
        static = self.static_weight
        states = self.state[self.state_names[pass_index]]
        conv = recurrent_step(  # (T, C) float32
            meta, [states],
            decode=lambda rows, slots: self.conv.update(
                x[rows], states, static, taps[rows], slots
            ),
            prefill=lambda rows: self.conv.varlen(
                x[rows], static, taps[rows], states, meta.prefill_query_start_loc,
                meta.prefill_state_indices, meta.prefill_has_initial_state,
            ),
        )  # fmt: skip
        return ((conv + x.float()) / self.divisor).to(x.dtype)
