"""Ling 3's KDA mixer (`BailingHybridForCausalLM`'s linear-attention layers): Kimi Delta
Attention with full-rank gates and the bounded ("safe") forget gate.

    q, k, v = silu(causal_conv(q_proj(x) | k_proj(x) | v_proj(x)))   # three depthwise convs
    a = f_proj(x)                                  # (T, Hv Dk): the forget gate, full rank
    b = b_proj(x)                                  # (T, Hv)
    o = kda(q, k, v, a, b)                         # g = lower_bound sigmoid(exp(A_log) (a +
                                                   # dt_bias)) with `kda_safe_gate`, else
                                                   # Kimi's -exp(A_log) softplus(a + dt_bias)
    y = o_proj(rmsnorm_per_head(o) * sigmoid(g_proj(x)))

Checkpoint names (`model.layers.N.attention.*`, loaded as `self_attn.*`): `q_proj`, `k_proj`,
`v_proj`, `q_conv1d`, `k_conv1d`, `v_conv1d`, `f_proj`, `dt_bias (Hv Dk,)`, `A_log (Hv,)`,
`b_proj`, `g_proj`, `o_norm (Dv,)`, `dense` (the output projection, `o_proj`). transformers'
in-memory names (`forget_gate.f_proj`, the fused `conv1d`) are mapped by the model.

Per-sequence state and tensor parallelism are `KimiDeltaAttention`'s (the full-rank gates are
split by head as q, k, v). Decode-only steps run fused as Kimi's (`fused_mixer_step`,
`layers.fused_delta_decode.plan_kda`), with single-stage gates: the first-stage projections
`[q | k | v | f | g | b]` (`FUSED_INPUTS`) give the forget gate's input and the output gate
themselves, no second stages (`FUSED_GATES` empty).

Glossary: T tokens in the step, H hidden size, Hv value heads, Dk / Dv their head dims.
"""

from __future__ import annotations

import torch

from vllm_mamba.distributed.parallel_state import TensorParallel
from vllm_mamba.layers.gated_deltanet import GatedDeltaShard, Projected
from vllm_mamba.layers.kimi_delta_attention import KimiDeltaAttention
from vllm_mamba.layers.parallel_linear import column_linear
from vllm_mamba.ops.table import MambaOps


class LingDeltaAttention(KimiDeltaAttention):
    """KDA with full-rank `f_proj` / `g_proj` and, when `lower_bound < 0`, the safe gate."""

    FUSED_INPUTS = ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj", "b_proj")
    FUSED_GATES = ()  # single-stage gates
    A_LOG_SHAPE = (-1,)  # `(Hv,)`

    def __init__(self, *args: object, lower_bound: float = 0.0, **kwargs: object) -> None:
        """Args: `KimiDeltaAttention`'s; `lower_bound` the safe gate's bound (negative), or 0
        for Kimi's softplus gate.

        Raises:
            ValueError: `lower_bound` is positive.
        """
        if lower_bound > 0:
            raise ValueError(f"kda_lower_bound must be negative (or 0), got {lower_bound}")
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lower_bound = float(lower_bound)

    def _build_projections(
        self, hidden_size: int, shard: GatedDeltaShard, ops: MambaOps, tp: TensorParallel
    ) -> None:
        keys, values = [shard.key_range()], [shard.value_range()]
        key_total, value_total = shard.key_total, shard.value_total
        gate_keys = [(shard.v_heads[0] * self.head_k_dim, shard.v_heads[1] * self.head_k_dim)]
        self.q_proj = column_linear(hidden_size, [key_total], False, ops, tp, keys)
        self.k_proj = column_linear(hidden_size, [key_total], False, ops, tp, keys)
        self.v_proj = column_linear(hidden_size, [value_total], False, ops, tp, values)
        total = shard.num_v_heads * self.head_k_dim
        self.f_proj = column_linear(hidden_size, [total], False, ops, tp, gate_keys)
        heads = [shard.v_heads]
        self.b_proj = column_linear(hidden_size, [shard.num_v_heads], False, ops, tp, heads)
        self.g_proj = column_linear(hidden_size, [value_total], False, ops, tp, values)

    def _project(self, hidden: torch.Tensor) -> Projected:
        qkv = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        return qkv, self.g_proj(hidden), self.b_proj(hidden), self.f_proj(hidden)
