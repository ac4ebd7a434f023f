"""The Mamba (S6) mixer over one flat varlen batch: decodes first, then prefill chunks.

Glossary: T tokens in the step, H hidden size, I intermediate size, N state size, R time-step
rank, K conv kernel width. Parameter names follow the Hugging Face checkpoints
(`in_proj`, `conv1d`, `x_proj`, `dt_proj`, `A_log`, `D`, `out_proj`).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.mamba_cache import LayerState
from vllm_mamba.ops.dispatch import MambaOps
from vllm_mamba.ops.linear import Linear, linear


class Conv1dWeights(nn.Module):
    """Holds the depthwise conv parameters under the checkpoint's names (`weight (I, 1, K)`)."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None


class MambaMixer(nn.Module):
    """Selective SSM block: in_proj -> causal conv -> selective scan -> gate -> out_proj."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        state_size: int,
        conv_kernel: int,
        time_step_rank: int,
        use_bias: bool,
        use_conv_bias: bool,
        ops: MambaOps,
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.state_size = state_size
        self.time_step_rank = time_step_rank
        self.ops = ops
        self.in_proj = Linear(hidden_size, 2 * intermediate_size, bias=use_bias)
        self.conv1d = Conv1dWeights(intermediate_size, conv_kernel, use_conv_bias)
        self.x_proj = Linear(intermediate_size, time_step_rank + 2 * state_size, bias=False)
        self.dt_proj = Linear(time_step_rank, intermediate_size, bias=True)
        self.A_log = nn.Parameter(torch.empty(intermediate_size, state_size))
        self.D = nn.Parameter(torch.empty(intermediate_size))
        self.out_proj = Linear(intermediate_size, hidden_size, bias=use_bias)
        self.register_buffer("A", torch.empty(0), persistent=False)
        self.register_buffer("conv_weight", torch.empty(0), persistent=False)

    def process_weights_after_loading(self) -> None:
        """Precomputes `A = -exp(A_log)` `(I, N)` float32 and the `(I, K)` conv filters."""
        self.A = -torch.exp(self.A_log.detach().float())
        self.conv_weight = self.conv1d.weight.detach()[:, 0, :].contiguous()

    def _conv(self, x: torch.Tensor, state: LayerState, meta: MambaMetadata) -> torch.Tensor:
        """Causal conv + SiLU of `x (T, I)`: decode rows by update, prefill chunks by varlen."""
        nd = meta.num_decodes
        parts = []
        if nd:
            parts.append(
                self.ops.causal_conv1d_update(
                    x[:nd], state.conv, self.conv_weight, self.conv1d.bias,
                    meta.decode_state_indices,
                )
            )  # fmt: skip
        if meta.num_prefills:
            parts.append(
                self.ops.causal_conv1d_varlen(
                    x[nd:], self.conv_weight, self.conv1d.bias, state.conv,
                    meta.prefill_query_start_loc, meta.prefill_state_indices,
                    meta.prefill_has_initial_state,
                )
            )  # fmt: skip
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def forward(self, hidden: torch.Tensor, state: LayerState, meta: MambaMetadata) -> torch.Tensor:
        """Mixes `hidden (T, H)` and advances each sequence's state in place.

        Returns:
            `(T, H)` in the model dtype.
        """
        nd = meta.num_decodes
        xz = self.in_proj(hidden)  # (T, 2I)
        x, z = xz.chunk(2, dim=-1)  # (T, I) each
        xc = self._conv(x, state, meta)  # (T, I)
        ssm_params = self.x_proj(xc)  # (T, R + 2N)
        ts, B, C = torch.split(
            ssm_params, [self.time_step_rank, self.state_size, self.state_size], dim=-1
        )
        dt = linear(ts, self.dt_proj.weight, None)  # (T, I), bias added in the kernel
        dt_bias = self.dt_proj.bias
        parts = []
        if nd:
            parts.append(
                self.ops.selective_state_update(
                    state.ssm, xc[:nd], dt[:nd], self.A, B[:nd], C[:nd], self.D, z[:nd],
                    dt_bias, True, meta.decode_state_indices,
                )
            )  # fmt: skip
        if meta.num_prefills:
            parts.append(
                self.ops.selective_scan_varlen(
                    xc[nd:], dt[nd:], self.A, B[nd:], C[nd:], self.D, z[nd:], dt_bias, True,
                    state.ssm, meta.prefill_query_start_loc, meta.prefill_state_indices,
                    meta.prefill_has_initial_state,
                )
            )  # fmt: skip
        y = parts[0] if len(parts) == 1 else torch.cat(parts)  # (T, I)
        return self.out_proj(y)
