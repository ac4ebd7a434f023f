"""Lightning attention: MiniMax-Text-01's linear-attention mixer over one flat varlen batch.

    q, k, v = act(qkv_proj(x)) per head          # rows `[q_h | k_h | v_h]` for each head h
    o = lightning(q, k, v)                       # ops family `lightning_attention`: per head
                                                 # S = exp(-s_h) S + k^T v, o = q S
    y = out_proj(sigmoid(output_gate(x)) * norm(o))   # RMSNorm over all heads at once

The slope of head `h` (0-based) in layer `l` of `L` is transformers' ALiBi-like rate
`(2 ** (-8 / H)) ** (h + 1) * (1 - l / (L - 1 + 1e-5) + 1e-5)`, computed from the config (the
checkpoints' `slope_rate` and block-decay buffers are derived from it and not loaded). `act` is
the config's `hidden_act` (SiLU in the releases); `norm` is an RMSNorm of width `H D` whose
epsilon is 1e-6 (transformers builds it without the config's).

Checkpoint names (`model.layers.N.self_attn.*`): `qkv_proj (3 H D, hidden)`, `output_gate
(H D, hidden)`, `norm (H D,)`, `out_proj (hidden, H D)`, no biases.

Per-sequence state (`state_spec`): `recurrent (H, D, D)` (stored `(Dv, Dk)` per head, the layout
of `ops.lightning_attention`), float32 unless `ssm_state_dtype` says otherwise.

With tensor parallelism (`tp`) each rank holds `H / N` heads: their rows of `qkv_proj` and
`output_gate`, their slopes and state, their channels of the norm (whose statistics are
all-reduced: `parallel_norm.projection_rms_norm`); `out_proj` is row-parallel.

Glossary: T tokens in the step, H heads (this rank's), D head dim, N ranks.
"""

from __future__ import annotations

import torch

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.mlp import activation
from vllm_mamba.layers.parallel_linear import column_linear, row_linear
from vllm_mamba.layers.parallel_norm import projection_rms_norm
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.layers.rowwise import rowwise
from vllm_mamba.ops.lightning_attention import lightning_ops
from vllm_mamba.ops.table import MambaOps

NORM_EPS = 1e-6  # transformers' MiniMaxLightningAttention norm keeps the RMSNorm default


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """`(num_heads,)` float32: each head's decay rate in layer `layer_idx` of `num_layers`
    (the formula of the module docstring, in transformers' order of float32 operations)."""
    base = 1 / (2 ** (8 / num_heads))
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return base ** (torch.arange(num_heads, device="cpu") + 1) * factor


class LightningAttention(StatefulLayer):
    """The mixer (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        layer_idx: int,
        num_layers: int,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
        *,
        act: str = "silu",
    ) -> None:
        super().__init__()
        heads = tp.split(num_heads, "num_attention_heads")  # this rank's
        first = tp.rank * heads
        width = num_heads * head_dim
        self.num_heads, self.head_dim = heads, head_dim
        self._slope_args = (num_heads, layer_idx, num_layers, first)
        self.act = activation(act)
        self.la = lightning_ops(ops)
        qkv_rows = [(first * 3 * head_dim, heads * 3 * head_dim)]
        channels = [(first * head_dim, heads * head_dim)]
        self.qkv_proj = column_linear(hidden_size, [3 * width], False, ops, tp, qkv_rows)
        self.output_gate = column_linear(hidden_size, [width], False, ops, tp, channels)
        self.norm = projection_rms_norm(width, NORM_EPS, tp, channels)
        self.out_proj = row_linear(width, hidden_size, False, ops, tp)
        self.register_buffer("slope", torch.empty(0), persistent=False)

    def process_weights_after_loading(self) -> None:
        """Computes this rank's slopes `(H,)` (float32) on the weights' device."""
        total, layer_idx, num_layers, first = self._slope_args
        slopes = lightning_slopes(total, layer_idx, num_layers)[first : first + self.num_heads]
        self.slope = slopes.to(self.qkv_proj.weight.device)

    def state_spec(self) -> StateSpec:
        """recurrent `(H, Dv, Dk)` (float32 by default)."""
        shape = (self.num_heads, self.head_dim, self.head_dim)
        return StateSpec((StateTensor("recurrent", shape),))

    def forward(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """Mixes `hidden (T, hidden)` and advances each sequence's state in place.

        `self.state["recurrent"]` is `(S, H, Dv, Dk)`.

        Returns:
            `(T, hidden)` in the model dtype.
        """
        num_tokens = hidden.shape[0]
        qkv = rowwise(self.act, self.qkv_proj(hidden))  # each row as alone (`layers.rowwise`)
        qkv = qkv.view(num_tokens, self.num_heads, 3 * self.head_dim)
        q, k, v = qkv.split(self.head_dim, dim=-1)  # (T, H, D) each
        rec = self.state["recurrent"]  # (S, H, Dv, Dk)
        o = recurrent_step(  # (T, H, Dv)
            meta, [rec],
            decode=lambda r, slots: self.la.update(
                q=q[r], k=k[r], v=v[r], slope=self.slope, ssm_states=rec, state_indices=slots,
            ),
            prefill=lambda r: self.la.varlen(
                q=q[r], k=k[r], v=v[r], slope=self.slope, ssm_states=rec,
                query_start_loc=meta.prefill_query_start_loc,
                state_indices=meta.prefill_state_indices,
                has_initial_state=meta.prefill_has_initial_state,
            ),
        )  # fmt: skip
        o = self.norm(o.reshape(num_tokens, self.num_heads * self.head_dim))
        return self.out_proj(rowwise(torch.sigmoid, self.output_gate(hidden)) * o)


__all__ = ["LightningAttention", "NORM_EPS", "lightning_slopes"]
