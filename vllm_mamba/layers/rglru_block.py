"""`RecurrentBlock`: Griffin's recurrent block (RecurrentGemma's `temporal_block` of its
`recurrent` layers) over one flat varlen batch.

    y = act(linear_y(h))                          # (T, L) the gate branch
    x = conv_1d(linear_x(h))                      # depthwise causal conv of width K, with bias
    gx, ga = block-diagonal gates of x            # per head: x_h @ W_h + b_h, (T, L) each
    x = rg_lru(x, gx, ga)                         # the gated diagonal recurrence (`ops.rglru`)
    out = linear_out(x * y)                       # (T, H)

The per-sequence state is the conv history `conv (L, K - 1)` (kind `conv`, the model dtype)
and the recurrence `h (L,)` (kind `recurrent`, float32). The conv runs through the
`causal_conv1d` ops without activation, the recurrence through the `rglru` ops; both go
through the one recurrent step, so decode rows, speculative waves, padding and prefill chunks
are handled there. The gates' two block-diagonal projections run as one `ops.block_linear`
(`input_gate_weight`, `recurrent_gate_weight`: `(NH, W, W)`, applied as `x_h @ W`).

In the checkpoints (`model.layers.N.temporal_block.*`): `linear_y`, `linear_x` `(L, H)` with
biases, `linear_out` `(H, L)` with bias, `conv_1d.weight (L, 1, K)` and `bias (L,)`,
`rg_lru.recurrent_param (L,)`, `rg_lru.input_gate_weight` / `recurrent_gate_weight`
`(NH, W, W)` and their biases `(NH, W)`.

Tensor parallelism (`tp`): each rank holds NH/N heads of W channels: its rows of `linear_y` and
`linear_x` (column-parallel), its conv filters, gates and `recurrent_param`, and its input
columns of `linear_out` (row-parallel, all-reduced).

Glossary: T tokens in the step, H hidden size, L channels (`lru_width`; this rank's under
tensor parallelism), NH heads (`num_attention_heads`), W = L / NH channels per head, K conv
width (`conv1d_width`), S state slots, N ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.mixer_base import Conv1dWeights, causal_conv
from vllm_mamba.layers.parallel_linear import column_linear, row_linear, shard_param
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.layers.rowwise import rowwise
from vllm_mamba.ops import rglru as rglru_ops
from vllm_mamba.ops.table import MambaOps

LOG_A_SCALE = -8.0  # Griffin's constant c: log a = c * sigmoid(ga) * softplus(param)


class RGLRU(nn.Module):
    """The RG-LRU's parameters under the checkpoint's names (`rg_lru.*`)."""

    def __init__(self, heads: int, width: int) -> None:
        super().__init__()
        self.recurrent_param = nn.Parameter(torch.empty(heads * width))
        self.input_gate_weight = nn.Parameter(torch.empty(heads, width, width))
        self.input_gate_bias = nn.Parameter(torch.empty(heads, width))
        self.recurrent_gate_weight = nn.Parameter(torch.empty(heads, width, width))
        self.recurrent_gate_bias = nn.Parameter(torch.empty(heads, width))


class RecurrentBlock(StatefulLayer):
    """`linear_out(rg_lru(conv(linear_x(h))) * act(linear_y(h)))` (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        lru_width: int,
        num_heads: int,
        conv_width: int,
        act: Callable[[torch.Tensor], torch.Tensor],
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        if lru_width % num_heads:
            raise ValueError(
                f"lru_width ({lru_width}) must be a multiple of num_attention_heads ({num_heads})"
            )
        width = lru_width // num_heads
        heads = tp.split(num_heads, "num_attention_heads")  # this rank's
        start = tp.rank * heads
        self.ops = ops
        self.lru = ops.family(rglru_ops.FAMILY)
        self.act = act
        self.channels, self.kernel, self.heads, self.width = heads * width, conv_width, heads, width
        self.linear_y = column_linear(hidden_size, [lru_width], True, ops, tp)
        self.linear_x = column_linear(hidden_size, [lru_width], True, ops, tp)
        self.conv_1d = Conv1dWeights(self.channels, conv_width, True)
        self.rg_lru = RGLRU(heads, width)
        self.linear_out = row_linear(lru_width, hidden_size, True, ops, tp)
        if tp.size > 1:
            channels = [(start * width, self.channels)]
            for module, name in [(self.conv_1d, "weight"), (self.conv_1d, "bias"),
                                 (self.rg_lru, "recurrent_param")]:  # fmt: skip
                shard_param(module, name, 0, channels, lru_width)
            for name in ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight",
                         "recurrent_gate_bias"):  # fmt: skip
                shard_param(self.rg_lru, name, 0, [(start, heads)], num_heads)
        for name in ("conv_weight", "gate_weight", "gate_bias", "log_a_scale"):
            self.register_buffer(name, torch.empty(0), persistent=False)

    def process_weights_after_loading(self) -> None:
        """Precomputes the `(L, K)` conv filters, the two gates as one `(NH, 2W, W)` weight
        and `(NH, 2W)` bias, and `log_a_scale = -8 softplus(recurrent_param)` (float32)."""
        lru = self.rg_lru
        self.conv_weight = self.conv_1d.weight.detach()[:, 0, :].contiguous()
        self.gate_weight = (
            torch.cat(  # (NH, 2W, W): `x_h @ W` as a linear's `(out, in)`
                [lru.input_gate_weight.detach(), lru.recurrent_gate_weight.detach()], dim=-1
            )
            .transpose(1, 2)
            .contiguous()
        )
        self.gate_bias = torch.cat(
            [lru.input_gate_bias.detach(), lru.recurrent_gate_bias.detach()], dim=-1
        ).contiguous()  # (NH, 2W)
        self.log_a_scale = LOG_A_SCALE * F.softplus(lru.recurrent_param.detach().float())

    def state_spec(self) -> StateSpec:
        """The conv history `(L, K - 1)` and the recurrence `(L,)`."""
        return StateSpec(
            (
                StateTensor("conv", (self.channels, self.kernel - 1), "conv"),
                StateTensor("h", (self.channels,), "recurrent"),
            )
        )

    def _gates(self, x: torch.Tensor) -> torch.Tensor:
        """The block-diagonal gate logits of `x (T, L)`: `(T, 2L)` as `[gx | ga]`, through
        `ops.block_linear` (whose decode-sized kernel sums each row as alone: a speculative
        chain's rows gate as the tokens decoded one by one)."""
        rows = x.shape[0]
        res = self.ops.block_linear(x, self.gate_weight, self.gate_bias)  # (T, NH 2W)
        gx, ga = res.view(rows, self.heads, 2 * self.width).chunk(2, dim=-1)  # (T, NH, W)
        return torch.cat([gx.reshape(rows, -1), ga.reshape(rows, -1)], dim=-1)

    def forward(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """Mixes `hidden (T, H)`, advancing each sequence's `conv` and `h` states in place.

        Returns:
            `(T, H)` in the model dtype.
        """
        y = rowwise(self.act, self.linear_y(hidden))  # (T, L), each row as alone
        conv_states, h_states = self.state["conv"], self.state["h"]
        x = causal_conv(
            self.ops, self.linear_x(hidden), self.conv_weight, self.conv_1d.bias, conv_states,
            meta, activation=False,
        )  # fmt: skip
        gates = self._gates(x)  # (T, 2L)
        x = recurrent_step(  # (T, L)
            meta, [h_states],
            decode=lambda r, slots: self.lru.update(
                x[r], gates[r], self.log_a_scale, h_states, slots
            ),
            prefill=lambda r: self.lru.varlen(
                x[r], gates[r], self.log_a_scale, h_states, meta.prefill_query_start_loc,
                meta.prefill_state_indices, meta.prefill_has_initial_state,
            ),
        )  # fmt: skip
        return self.linear_out(x * y)
