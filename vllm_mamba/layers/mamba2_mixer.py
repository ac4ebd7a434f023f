"""The Mamba2 (SSD) mixer over one flat varlen batch: decodes first, then prefill chunks.

Glossary: T tokens in the step, H hidden size, I intermediate size (`expand * H`), NH heads,
P head dim (`I = NH * P`), G groups sharing B and C, N state size, K conv kernel width,
CD conv channels (`I + 2 G N`: x, B and C go through the conv together). Parameter names
follow the Hugging Face checkpoints (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`,
`out_proj`).

With tensor parallelism (`tp`) each rank holds `NH / tp.size` heads (the counts above are then
this rank's), their channels of z and x, the B and C groups they read (split, or replicated
when there are fewer groups than ranks), their `dt_bias`, `A_log` and `D`, and the matching
part of the state; `out_proj` is row-parallel and the gated norm all-reduces its variance when
a group spans ranks (`vllm_mamba.layers.parallel_norm`).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decode_plan import FusedStep
from vllm_mamba.layers.fused_decode_layer import plan_mamba2
from vllm_mamba.layers.mixer_base import StateSpaceMixer
from vllm_mamba.layers.mixer_sharding import mamba2_shard, shard_mixer_params
from vllm_mamba.layers.parallel_linear import column_linear, row_linear
from vllm_mamba.layers.parallel_norm import gated_rms_norm
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.ops.table import MambaOps


class Mamba2Mixer(StateSpaceMixer):
    """in_proj -> (z, xBC, dt); conv on xBC -> SSD scan per head -> gated norm -> out_proj."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        state_size: int,
        conv_kernel: int,
        chunk_size: int,
        time_step_limit: tuple[float, float],
        use_bias: bool,
        use_conv_bias: bool,
        norm_eps: float,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
    ) -> None:
        intermediate = num_heads * head_dim
        gn = n_groups * state_size
        shard = mamba2_shard(num_heads, head_dim, n_groups, tp)
        local = shard.channels[1]
        conv_dim = local + 2 * shard.n_groups * state_size
        super().__init__(conv_dim, conv_kernel, use_conv_bias, (shard.num_heads,), ops)
        self.num_heads = shard.num_heads
        self.head_dim = head_dim
        self.n_groups = shard.n_groups
        self.state_size = state_size
        self.chunk_size = chunk_size
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.intermediate_size = local
        self.conv_dim = conv_dim
        in_sections = [intermediate, intermediate + 2 * gn, num_heads]
        in_ranges = shard.in_proj_ranges(intermediate, gn, state_size) if tp.size > 1 else None
        self.in_proj = column_linear(hidden_size, in_sections, use_bias, ops, tp, in_ranges)
        self.dt_bias = nn.Parameter(torch.empty(shard.num_heads))
        group_size = intermediate // n_groups
        self.norm = gated_rms_norm(intermediate, group_size, norm_eps, ops, tp, shard.channels)
        self.out_proj = row_linear(intermediate, hidden_size, use_bias, ops, tp)
        if tp.size > 1:
            conv_ranges = shard.conv_ranges(intermediate, gn, state_size)
            shard_mixer_params(self, conv_ranges, intermediate + 2 * gn, [shard.heads], num_heads)

    def state_spec(self) -> StateSpec:
        """conv `(CD, K - 1)` (the model dtype) and ssm `(NH, P, N)` (float32 by default)."""
        kernel = self.conv1d.weight.shape[-1]
        return StateSpec((
            StateTensor("conv", (self.conv_dim, kernel - 1), "conv"),
            StateTensor("ssm", (self.num_heads, self.head_dim, self.state_size)),
        ))  # fmt: skip

    def _split_heads(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output `(T, CD)` -> x `(T, NH, P)`, B `(T, G, N)`, C `(T, G, N)` (views)."""
        num_tokens = xbc.shape[0]
        gn = self.n_groups * self.state_size
        x, B, C = xbc.split([self.intermediate_size, gn, gn], dim=-1)
        x = x.reshape(num_tokens, self.num_heads, self.head_dim)
        B = B.reshape(num_tokens, self.n_groups, self.state_size)
        C = C.reshape(num_tokens, self.n_groups, self.state_size)
        return x, B, C

    def fused_mixer_step(
        self, norm: nn.Module | None, residual_in_fp32: bool, residual_scale: float = 1.0
    ) -> FusedStep | None:
        """The decode-only steps in one fused kernel call (with the block's `norm` and residual,
        scaled by `residual_scale`, when given), planned once; None where that does not apply
        (`fused_decode_layer`)."""
        return plan_mamba2(self, norm, residual_in_fp32, residual_scale)

    def forward(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """Mixes `hidden (T, H)` and advances each sequence's state in place.

        `self.state["conv"]` is `(S, CD, K - 1)` and `self.state["ssm"]` `(S, NH, P, N)`.

        Returns:
            `(T, H)` in the model dtype.
        """
        zxbcdt = self._project(hidden)  # (T, I + CD + NH)
        z, xbc, dt = zxbcdt.split([self.intermediate_size, self.conv_dim, self.num_heads], -1)
        x, B, C = self._split_heads(self.conv(xbc, meta))
        shared = {"A": self.A, "D_skip": self.D, "dt_bias": self.dt_bias, "dt_softplus": True}
        ssm = self.state["ssm"]  # (S, NH, P, N)
        y = recurrent_step(  # (T, NH, P)
            meta, [ssm],
            decode=lambda r, slots: self.ops.ssd_state_update(
                ssm_states=ssm, x=x[r], dt=dt[r], B_=B[r], C=C[r], state_indices=slots, **shared,
            ),
            prefill=lambda r: self.ops.ssd_chunk_scan_varlen(
                x=x[r], dt=dt[r], B_=B[r], C=C[r], dt_limit=self.time_step_limit,
                ssm_states=ssm, query_start_loc=meta.prefill_query_start_loc,
                state_indices=meta.prefill_state_indices,
                has_initial_state=meta.prefill_has_initial_state, chunk_size=self.chunk_size,
                **shared,
            ),
        )  # fmt: skip
        return self.out_proj(self._gate(y.reshape(-1, self.intermediate_size), z))

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The input projection `(T, H) -> (T, I + CD + NH)`; models with multipliers override."""
        return self.in_proj(hidden)

    def _gate(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated RMSNorm of the scan output `y (T, I)` by `z (T, I)`."""
        return self.norm(y, z)
