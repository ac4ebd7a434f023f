"""The multi-head Mamba (S6) mixer of Zamba v1, over one flat varlen batch.

Mamba's selective SSM (`mamba_mixer`) with its channels split into `NH` heads of `P`
channels: `in_proj`, the causal conv and `out_proj` span every channel as in Mamba, but each
head has its own time-step, B and C projection (`x_proj_weight (NH, R + 2N, P)`), its own
time-step projection (`dt_proj_weight (NH, P, R)`, `dt_proj_bias (NH, P)`) and runs its own
scan with its B and C; `A_log (NH, P, N)` and `D (NH, P)` are per channel, by head. The heads'
outputs, concatenated, are gated and projected as in Mamba.

The state is `conv (I, K - 1)` and `ssm (NH, P, N)` per sequence. The scan ops take one
`(S, P, N)` state tensor: `ssm (S, NH, P, N)` is read as `(S * NH, P, N)`, head `h` of slot
`s` at `s * NH + h`, so each head runs the Mamba ops unchanged on its own rows.

With tensor parallelism (`tp`) each rank holds `NH / tp.size` whole heads: `in_proj` (x and z
halves), the conv and every per-head tensor split by heads, `out_proj` row-parallel
(all-reduced); the per-head projections need no communication.

Glossary: T tokens in the step, H hidden size, I intermediate size (this rank's), NH heads
(this rank's), P head dim, N state size, R time-step rank, K conv kernel width, S state slots.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import PAD_SLOT_ID, StateSpec, StateTensor
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.mixer_base import StateSpaceMixer
from vllm_mamba.layers.mixer_sharding import shard_mixer_params
from vllm_mamba.layers.parallel_linear import column_linear, row_linear, shard_param
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.ops.table import MambaOps

PER_HEAD = ("x_proj_weight", "dt_proj_weight", "dt_proj_bias")  # besides A_log and D


class MultiHeadMambaMixer(StateSpaceMixer):
    """in_proj -> causal conv -> per head: x_proj, dt_proj, selective scan -> gate ->
    out_proj."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        state_size: int,
        conv_kernel: int,
        time_step_rank: int,
        use_bias: bool,
        use_conv_bias: bool,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
    ) -> None:
        if intermediate_size % num_heads:
            raise ValueError(
                f"n_mamba_heads ({num_heads}) must divide the Mamba width ({intermediate_size})"
            )
        head_dim = intermediate_size // num_heads
        first, heads = tp.range(num_heads, "n_mamba_heads")  # this rank's
        local = heads * head_dim
        super().__init__(local, conv_kernel, use_conv_bias, (heads, head_dim, state_size), ops)
        self.D = nn.Parameter(torch.empty(heads, head_dim))  # per channel, by head
        self.num_heads, self.head_dim = heads, head_dim
        self.state_size, self.time_step_rank = state_size, time_step_rank
        params = time_step_rank + 2 * state_size
        self.x_proj_weight = nn.Parameter(torch.empty(heads, params, head_dim))
        self.dt_proj_weight = nn.Parameter(torch.empty(heads, head_dim, time_step_rank))
        self.dt_proj_bias = nn.Parameter(torch.empty(heads, head_dim))
        inter = intermediate_size
        self.in_proj = column_linear(hidden_size, [inter, inter], use_bias, ops, tp)
        self.out_proj = row_linear(inter, hidden_size, use_bias, ops, tp)
        if tp.size > 1:
            head_ranges = [(first, heads)]
            shard_mixer_params(self, [(first * head_dim, local)], inter, head_ranges, num_heads)
            for name in PER_HEAD:
                shard_param(self, name, 0, head_ranges, num_heads)

    def state_spec(self) -> StateSpec:
        """conv `(I, K - 1)` (the model dtype) and ssm `(NH, P, N)` (float32 by default)."""
        kernel = self.conv1d.weight.shape[-1]
        local = self.num_heads * self.head_dim
        return StateSpec((
            StateTensor("conv", (local, kernel - 1), "conv"),
            StateTensor("ssm", (self.num_heads, self.head_dim, self.state_size)),
        ))  # fmt: skip

    def _ssm_params(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`xc (T, I)` -> per head: dt `(NH, T, P)` (before its bias), B, C `(NH, T, N)`."""
        rows, heads = xc.shape[0], self.num_heads
        # Block-diagonal products (`ops.block_linear`: a decode-sized step sums each row as
        # alone, so a speculative chain's rows equal the tokens decoded one by one).
        params = self.ops.block_linear(xc, self.x_proj_weight, None)  # (T, NH (R + 2N))
        params = params.view(rows, heads, -1)
        sizes = [self.time_step_rank, self.state_size, self.state_size]
        ts, B, C = params.split(sizes, dim=-1)  # (T, NH, R), (T, NH, N), (T, NH, N)
        dt = self.ops.block_linear(ts.reshape(rows, -1), self.dt_proj_weight, None)  # (T, NH P)
        dt = dt.view(rows, heads, self.head_dim).transpose(0, 1)  # (NH, T, P)
        return dt, B.transpose(0, 1), C.transpose(0, 1)

    def _head_slots(self, slots: torch.Tensor, head: int) -> torch.Tensor:
        """Slot indices `(B,)` -> head `head`'s rows of the `(S * NH, P, N)` state view."""
        return torch.where(slots == PAD_SLOT_ID, slots, slots * self.num_heads + head)

    def forward(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """Mixes `hidden (T, H)` and advances each sequence's state in place.

        Returns:
            `(T, H)` in the model dtype.
        """
        num_tokens = hidden.shape[0]
        x, z = self.in_proj(hidden).chunk(2, dim=-1)  # (T, I) each
        xc = self.conv(x, meta)  # (T, I)
        dt, B, C = self._ssm_params(xc)
        u = xc.view(num_tokens, self.num_heads, self.head_dim).transpose(0, 1)  # (NH, T, P)
        gate = z.view(num_tokens, self.num_heads, self.head_dim).transpose(0, 1)  # (NH, T, P)
        ssm = self.state["ssm"]  # (S, NH, P, N)
        rows_view = ssm.view(-1, self.head_dim, self.state_size)  # (S * NH, P, N)

        def head_args(h: int, r: slice) -> dict[str, object]:
            return {
                "u": u[h, r], "dt": dt[h, r], "B_": B[h, r], "C": C[h, r], "z": gate[h, r],
                "A": self.A[h], "D_skip": self.D[h], "dt_bias": self.dt_proj_bias[h],
                "dt_softplus": True, "ssm_states": rows_view,
            }  # fmt: skip

        def decode(r: slice, slots: torch.Tensor) -> torch.Tensor:
            return torch.cat([
                self.ops.selective_state_update(
                    **head_args(h, r), state_indices=self._head_slots(slots, h)
                )
                for h in range(self.num_heads)
            ], dim=-1)  # fmt: skip

        def prefill(r: slice) -> torch.Tensor:
            return torch.cat([
                self.ops.selective_scan_varlen(
                    **head_args(h, r), query_start_loc=meta.prefill_query_start_loc,
                    state_indices=self._head_slots(meta.prefill_state_indices, h),
                    has_initial_state=meta.prefill_has_initial_state,
                )
                for h in range(self.num_heads)
            ], dim=-1)  # fmt: skip

        y = recurrent_step(meta, [ssm], decode, prefill)  # (T, I)
        return self.out_proj(y)
