"""The Mamba2 (SSD) mixer over one flat varlen batch: decodes first, then prefill chunks.

Glossary: T tokens in the step, H hidden size, I intermediate size (`expand * H`), NH heads,
P head dim (`I = NH * P`), G groups sharing B and C, N state size, K conv kernel width,
CD conv channels (`I + 2 G N`: x, B and C go through the conv together). Parameter names
follow the Hugging Face checkpoints (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`,
`out_proj`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.layers.mamba_mixer import Conv1dWeights
from vllm_mamba.mamba_cache import LayerState
from vllm_mamba.ops.dispatch import MambaOps


class GatedRMSNorm(nn.Module):
    """`weight * rmsnorm_per_group(x * silu(z))`, statistics over groups of `group_size`."""

    def __init__(self, hidden_size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """`x, z (T, I)` -> `(T, I)` in x's dtype (math in float32)."""
        gated = x.float() * F.silu(z.float())  # (T, I)
        groups = gated.view(*gated.shape[:-1], -1, self.group_size)  # (T, I / gs, gs)
        variance = groups.pow(2).mean(-1, keepdim=True)
        normed = (groups * torch.rsqrt(variance + self.variance_epsilon)).view_as(gated)
        return self.weight * normed.to(x.dtype)


class Mamba2Mixer(nn.Module):
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
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.n_groups = n_groups
        self.state_size = state_size
        self.chunk_size = chunk_size
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.ops = ops
        self.in_proj = nn.Linear(
            hidden_size, self.intermediate_size + self.conv_dim + num_heads, bias=use_bias
        )
        self.conv1d = Conv1dWeights(self.conv_dim, conv_kernel, use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.D = nn.Parameter(torch.empty(num_heads))
        group_size = self.intermediate_size // n_groups
        self.norm = GatedRMSNorm(self.intermediate_size, group_size, norm_eps)
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=use_bias)
        self.register_buffer("A", torch.empty(0), persistent=False)
        self.register_buffer("conv_weight", torch.empty(0), persistent=False)

    def process_weights_after_loading(self) -> None:
        """Precomputes `A = -exp(A_log)` `(NH,)` float32 and the `(CD, K)` conv filters."""
        self.A = -torch.exp(self.A_log.detach().float())
        self.conv_weight = self.conv1d.weight.detach()[:, 0, :].contiguous()

    def forward(self, hidden: torch.Tensor, state: LayerState, meta: MambaMetadata) -> torch.Tensor:
        """Mixes `hidden (T, H)` and advances each sequence's state in place.

        `state.conv` is `(S, CD, K - 1)` and `state.ssm` is `(S, NH, P, N)`.

        Returns:
            `(T, H)` in the model dtype.
        """
        nd = meta.num_decodes
        num_tokens = hidden.shape[0]
        conv_bias = self.conv1d.bias
        zxbcdt = self.in_proj(hidden)  # (T, I + CD + NH)
        z, xbc, dt = zxbcdt.split([self.intermediate_size, self.conv_dim, self.num_heads], -1)
        xbc_c = torch.empty_like(xbc)  # (T, CD) conv output
        if nd:
            xbc_c[:nd] = self.ops.causal_conv1d_update(
                xbc[:nd], state.conv, self.conv_weight, conv_bias, meta.decode_state_indices
            )
        if meta.num_prefills:
            xbc_c[nd:] = self.ops.causal_conv1d_varlen(
                xbc[nd:],
                self.conv_weight,
                conv_bias,
                state.conv,
                meta.prefill_query_start_loc,
                meta.prefill_state_indices,
                meta.prefill_has_initial_state,
            )
        gn = self.n_groups * self.state_size
        x, B, C = xbc_c.split([self.intermediate_size, gn, gn], dim=-1)
        x = x.reshape(num_tokens, self.num_heads, self.head_dim)  # (T, NH, P)
        B = B.reshape(num_tokens, self.n_groups, self.state_size)  # (T, G, N)
        C = C.reshape(num_tokens, self.n_groups, self.state_size)  # (T, G, N)
        y = torch.empty_like(x)  # (T, NH, P)
        if nd:
            y[:nd] = self.ops.ssd_state_update(
                state.ssm, x[:nd], dt[:nd], self.A, B[:nd], C[:nd], self.D, self.dt_bias, True,
                meta.decode_state_indices,
            )  # fmt: skip
        if meta.num_prefills:
            y[nd:] = self.ops.ssd_chunk_scan_varlen(
                x[nd:], dt[nd:], self.A, B[nd:], C[nd:], self.D, self.dt_bias, True,
                self.time_step_limit, state.ssm, meta.prefill_query_start_loc,
                meta.prefill_state_indices, meta.prefill_has_initial_state, self.chunk_size,
            )  # fmt: skip
        return self.out_proj(self.norm(y.view(num_tokens, self.intermediate_size), z))
