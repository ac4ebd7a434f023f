"""Kimi Delta Attention (KDA): Kimi Linear's recurrent mixer, the Gated DeltaNet with a decay
per key channel, over one flat varlen batch.

    q, k, v = silu(causal_conv(q_proj(x) | k_proj(x) | v_proj(x)))   # three depthwise convs
    a = f_b_proj(f_a_proj(x))                      # (T, Hv Dk): the low-rank forget gate
    b = b_proj(x)                                  # (T, Hv)
    o = kda(q, k, v, a, b)                         # ops family `kda`: L2 norms, per-channel
                                                   # decay g = -exp(A_log) softplus(a + dt_bias),
                                                   # beta = sigmoid(b), the delta rule over S
    y = o_proj(rmsnorm_per_head(o) * sigmoid(g_b_proj(g_a_proj(x))))

The decay above is Kimi's softplus gate (`lower_bound` 0); a mixer with transformers' bounded
safe gate (Ling-3.0, GLM-5-Next: `kda_safe_gate`, `kda_lower_bound < 0`) sets `lower_bound`,
and g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias)); every op that computes g (prefill,
decode, the fused decode step) takes it.

Checkpoint names (`model.layers.N.self_attn.*`): `q_proj`, `k_proj`, `v_proj`, `q_conv1d`,
`k_conv1d`, `v_conv1d` (concatenated after loading, as OLMo Hybrid's), `f_a_proj`, `f_b_proj`,
`dt_bias (Hv Dk,)`, `A_log (1, 1, Hv, 1)`, `b_proj`, `g_a_proj`, `g_b_proj`, `o_norm (Dv,)`,
`o_proj`. Kimi Linear has as many key as value heads and `Dk = Dv`; the skeleton (the Gated
DeltaNet's) does not require it.

Per-sequence state: `conv (CD, K - 1)` in the model dtype and `recurrent (Hv, Dk, Dv)`,
float32 unless `ssm_state_dtype` says otherwise.

A layer's decode-only steps may run as one fused call (`fused_mixer_step`, planned once:
`layers.fused_delta_decode.plan_kda`), with the block's norm and residual: the first-stage
projections in the order of their outputs `[q | k | v | f_a | g_a | b]` (`FUSED_INPUTS`), the
gates' second stages `f_b_proj`, `g_b_proj` (`FUSED_GATES`; empty for single-stage gates, as
Ling 3's full-rank `f_proj`, `g_proj`: `layers.ling_delta_attention`).

With tensor parallelism each rank holds its heads: their rows of q, k, v, `f_b_proj`,
`g_b_proj` and `b_proj`, their conv channels, `dt_bias` and `A_log`; the low-rank `f_a_proj`
and `g_a_proj` are replicated, `o_proj` row-parallel.

Glossary: T tokens in the step, H hidden size, Hk / Hv key / value heads, Dk / Dv their head
dims, R the gates' low rank (`f_a_proj`'s outputs, `Dk` in the releases), CD conv channels.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.distributed.parallel_state import TensorParallel
from vllm_mamba.layers.decode_plan import FusedStep
from vllm_mamba.layers.fused_delta_decode import plan_kda
from vllm_mamba.layers.gated_deltanet import (
    GatedDeltaShard,
    HeadGatedRMSNorm,
    OlmoHybridGatedDeltaNet,
    Projected,
)
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.parallel_linear import column_linear, shard_param
from vllm_mamba.ops import kda
from vllm_mamba.ops.table import MambaOps


class KimiDeltaAttention(OlmoHybridGatedDeltaNet):
    """The KDA mixer: OLMo Hybrid's separate projections and three convs, Kimi's gates."""

    OUT = "o_proj"
    NORM = "o_norm"
    FAMILY = kda.FAMILY
    FUSED_INPUTS = ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj")
    FUSED_GATES = ("f_b_proj", "g_b_proj")
    # The forget gate (`ops.kda.kda_gates_ref`): 0 for Kimi's softplus gate; a subclass with
    # transformers' bounded safe gate (`kda_safe_gate`) sets its `kda_lower_bound` (< 0), and
    # g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias)).
    lower_bound: float = 0.0
    A_LOG_SHAPE: tuple[int, ...] = (1, 1, -1, 1)  # Kimi's `(1, 1, Hv, 1)`

    def _build_projections(
        self, hidden_size: int, shard: GatedDeltaShard, ops: MambaOps, tp: TensorParallel
    ) -> None:
        keys, values = [shard.key_range()], [shard.value_range()]
        key_total, value_total = shard.key_total, shard.value_total
        rank = self.head_k_dim  # the releases' low rank of both gates
        gate_keys = [(shard.v_heads[0] * self.head_k_dim, shard.v_heads[1] * self.head_k_dim)]
        self.q_proj = column_linear(hidden_size, [key_total], False, ops, tp, keys)
        self.k_proj = column_linear(hidden_size, [key_total], False, ops, tp, keys)
        self.v_proj = column_linear(hidden_size, [value_total], False, ops, tp, values)
        self.f_a_proj = Linear(hidden_size, rank, False, ops)
        total = shard.num_v_heads * self.head_k_dim
        self.f_b_proj = column_linear(rank, [total], False, ops, tp, gate_keys)
        heads = [shard.v_heads]
        self.b_proj = column_linear(hidden_size, [shard.num_v_heads], False, ops, tp, heads)
        self.g_a_proj = Linear(hidden_size, rank, False, ops)
        self.g_b_proj = column_linear(rank, [value_total], False, ops, tp, values)

    def _build_gates(self, shard: GatedDeltaShard, tp: TensorParallel) -> None:
        """`A_log` per head in the checkpoint's shape (`A_LOG_SHAPE`, -1 where the heads go)
        and `dt_bias (Hv Dk,)` per key channel."""
        head_dim = self.A_LOG_SHAPE.index(-1)
        shape = [self.num_v_heads if n == -1 else n for n in self.A_LOG_SHAPE]
        self.A_log = nn.Parameter(torch.empty(shape))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads * self.head_k_dim))
        if tp.size > 1:
            first, count = shard.v_heads
            shard_param(self, "A_log", head_dim, [shard.v_heads], shard.num_v_heads)
            channels = [(first * self.head_k_dim, count * self.head_k_dim)]
            shard_param(self, "dt_bias", 0, channels, shard.num_v_heads * self.head_k_dim)

    def _gate_args(self) -> dict[str, object]:
        return {
            "A_log": self.A_log.view(-1),
            "dt_bias": self.dt_bias,
            "lower_bound": self.lower_bound,
        }

    def _project(self, hidden: torch.Tensor) -> Projected:
        qkv = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        gate = self.g_b_proj(self.g_a_proj(hidden))  # (T, Hv Dv): the output norm's gate
        a = self.f_b_proj(self.f_a_proj(hidden))  # (T, Hv Dk): the forget gate
        return qkv, gate, self.b_proj(hidden), a

    def fused_mixer_step(
        self, norm: nn.Module | None, residual_in_fp32: bool, residual_scale: float = 1.0
    ) -> FusedStep | None:
        """The decode-only steps in one fused kernel call (`plan_kda`), planned once; None where
        that does not apply (another output norm, a residual multiplier)."""
        if residual_scale != 1.0 or type(getattr(self, self.NORM)) is not HeadGatedRMSNorm:
            return None
        return plan_kda(self, norm, residual_in_fp32)
