"""The Mamba (S6) mixer over one flat varlen batch: decodes first, then prefill chunks.

Also FalconMamba's: with `mixer_rms_eps` set, the time step, B and C that `x_proj` produces
are each RMS-normalised (no weight) before the scan.

With tensor parallelism (`tp`) each rank holds `I / tp.size` channels: `in_proj`, `conv1d` and
`dt_proj` are column-parallel, `x_proj` and `out_proj` row-parallel (all-reduced).

Glossary: T tokens in the step, H hidden size, I intermediate size (this rank's), N state
size, R time-step rank, K conv kernel width. Parameter names follow the Hugging Face checkpoints
(`in_proj`, `conv1d`, `x_proj`, `dt_proj`, `A_log`, `D`, `out_proj`).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decode_plan import FusedStep
from vllm_mamba.layers.fused_decode_layer import plan_mamba
from vllm_mamba.layers.layernorm import weightless_rms_norm
from vllm_mamba.layers.mixer_base import StateSpaceMixer
from vllm_mamba.layers.mixer_sharding import shard_mixer_params
from vllm_mamba.layers.parallel_linear import column_linear, row_linear
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.ops.table import MambaOps


class MambaMixer(StateSpaceMixer):
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
        mixer_rms_eps: float | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        local = tp.split(intermediate_size, "intermediate_size")  # this rank's channels
        super().__init__(local, conv_kernel, use_conv_bias, (local, state_size), ops)
        self.intermediate_size = local
        self.state_size = state_size
        self.time_step_rank = time_step_rank
        self.mixer_rms_eps = mixer_rms_eps
        inter = intermediate_size
        self.in_proj = column_linear(hidden_size, [inter, inter], use_bias, ops, tp)
        self.x_proj = row_linear(inter, time_step_rank + 2 * state_size, False, ops, tp)
        self.dt_proj = column_linear(time_step_rank, [inter], True, ops, tp)
        self.out_proj = row_linear(inter, hidden_size, use_bias, ops, tp)
        if tp.size > 1:
            channels = [tp.range(inter, "intermediate_size")]
            shard_mixer_params(self, channels, inter, channels, inter)

    def state_spec(self) -> StateSpec:
        """conv `(I, K - 1)` (the model dtype) and ssm `(I, N)` (float32 by default)."""
        kernel = self.conv1d.weight.shape[-1]
        return StateSpec((
            StateTensor("conv", (self.intermediate_size, kernel - 1), "conv"),
            StateTensor("ssm", (self.intermediate_size, self.state_size)),
        ))  # fmt: skip

    def _ssm_params(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`xc (T, I)` -> dt `(T, I)` (before its bias), B `(T, N)`, C `(T, N)`."""
        sizes = [self.time_step_rank, self.state_size, self.state_size]
        ts, B, C = self.x_proj(xc).split(sizes, dim=-1)  # (T, R), (T, N), (T, N)
        if self.mixer_rms_eps is not None:
            ts, B, C = (weightless_rms_norm(t, self.mixer_rms_eps) for t in (ts, B, C))
        dt = self.ops.linear(ts, self.dt_proj.weight, None)  # (T, I), bias added in the scan
        return dt, B, C

    def fused_mixer_step(
        self, norm: nn.Module | None, residual_in_fp32: bool, residual_scale: float = 1.0
    ) -> FusedStep | None:
        """The decode-only steps in one fused kernel call (with the block's `norm` and residual
        when given), planned once; None where that does not apply (`fused_decode_layer`; a
        residual multiplier)."""
        if residual_scale != 1.0:
            return None
        return plan_mamba(self, norm, residual_in_fp32)

    def forward(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """Mixes `hidden (T, H)` and advances each sequence's state in place.

        Returns:
            `(T, H)` in the model dtype.
        """
        x, z = self.in_proj(hidden).chunk(2, dim=-1)  # (T, I) each
        xc = self.conv(x, meta)  # (T, I)
        dt, B, C = self._ssm_params(xc)
        shared = {"A": self.A, "D_skip": self.D, "dt_bias": self.dt_proj.bias, "dt_softplus": True}
        ssm = self.state["ssm"]  # (S, I, N)
        y = recurrent_step(  # (T, I)
            meta, [ssm],
            decode=lambda r, slots: self.ops.selective_state_update(
                ssm_states=ssm, u=xc[r], dt=dt[r], B_=B[r], C=C[r], z=z[r], state_indices=slots,
                **shared,
            ),
            prefill=lambda r: self.ops.selective_scan_varlen(
                u=xc[r], dt=dt[r], B_=B[r], C=C[r], z=z[r], ssm_states=ssm,
                query_start_loc=meta.prefill_query_start_loc,
                state_indices=meta.prefill_state_indices,
                has_initial_state=meta.prefill_has_initial_state, **shared,
            ),
        )  # fmt: skip
        return self.out_proj(y)
