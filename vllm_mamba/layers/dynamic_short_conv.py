"""`DynamicShortConv`: a depthwise causal conv whose taps are static per channel plus per-token
ones projected from another input, added to its own input (Inkling 2's convs over the keys and
values of its full-attention layers).

    w[t, c, l] = static_weight[l, c] + weight_proj(u_t)[head(c) * K + l]   # l: lag, 0 = now
    y[t, c] = (x[t, c] + sum_l w[t, c, l] * x[t - l, c]) / sqrt(2K + 1)    # float32

`x (T, C)` is what is convolved (a key or value projection), `u (T, H)` the input the per-token
taps come from (the projection's own input), shared by the `C / heads` channels of each
key/value head. Inputs before a sequence's first token are zeros. The per-sequence state is
the last K - 1 inputs, `conv (C, K - 1)` oldest first, float32, as `causal_conv1d`'s. No op
family computes per-token taps, so the windows are built here in PyTorch, through
`recurrent_step` (decode rows by their slots, prefill chunks one by one from their saved
histories), and the taps applied in lag order as transformers sums them.

Tensor parallelism: this rank's key/value heads (`head_range`): their channels of
`static_weight`, their rows of `weight_proj`.

Glossary: T tokens in the step, H input width, C channels (this rank's), K conv width, S slots.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import PAD_SLOT_ID, StateSpec, StateTensor
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.parallel_linear import column_linear, shard_param
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.layers.residual_short_conv import pass_state_names
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
        num_tokens, k = x.shape[0], self.kernel
        xf = x.float()
        dynamic = self.weight_proj(u).float().view(num_tokens, self.num_heads, 1, k)
        static = self.static_weight.float().T.reshape(self.num_heads, -1, k)  # (heads, C/h, K)
        taps = (static + dynamic).reshape(num_tokens, self.channels, k)  # (T, C, K) by lag
        states = self.state[self.state_names[pass_index]]
        windows = recurrent_step(  # (T, C, K), oldest first
            meta, [states],
            decode=lambda rows, slots: _decode_windows(xf[rows], states, slots),
            prefill=lambda rows: _prefill_windows(xf[rows], states, meta),
        )  # fmt: skip
        out = (windows.flip(-1) * taps).sum(-1)  # (T, C)
        return ((out + xf) / self.divisor).to(x.dtype)


def _decode_windows(x: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`x (B, C)` one token per row -> windows `(B, C, K)` over each row's saved history, the
    histories shifted in place (padding rows: a zero history, nothing written)."""
    valid = slots != PAD_SLOT_ID
    index = slots.long().clamp(min=0)
    history = states[index].float() * valid[:, None, None]  # (B, C, K - 1)
    windows = torch.cat([history, x[:, :, None]], dim=-1)
    if bool(valid.any()):
        states[index[valid]] = windows[valid, :, 1:].to(states.dtype)
    return windows


def _prefill_windows(x: torch.Tensor, states: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
    """The prefill chunks' tokens `x (T, C)` -> windows `(T, C, K)`, each chunk from its slot's
    history (zeros without one), the histories replaced by each chunk's last inputs."""
    hist = states.shape[-1]
    starts = meta.prefill_query_start_loc.tolist()
    slots = meta.prefill_state_indices.tolist()
    initial = meta.prefill_has_initial_state.tolist()
    parts = []
    for seq, slot in enumerate(slots):
        chunk = x[starts[seq] : starts[seq + 1]].T  # (C, n)
        if chunk.shape[1] == 0:  # a padding chunk
            continue
        history = chunk.new_zeros(chunk.shape[0], hist)
        if slot != PAD_SLOT_ID and initial[seq]:
            history = states[slot].float()
        ext = torch.cat([history, chunk], dim=-1)  # (C, K - 1 + n)
        parts.append(ext.unfold(-1, hist + 1, 1).transpose(0, 1))  # (n, C, K)
        if slot != PAD_SLOT_ID:
            states[slot] = ext[:, ext.shape[-1] - hist :].to(states.dtype)
    return torch.cat(parts) if parts else x.new_zeros(0, x.shape[1], hist + 1)
