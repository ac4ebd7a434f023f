"""`CCAttention`: Compressed Convolutional Attention (CCA, ZAYA1's `self_attn`), over one flat
varlen batch: softmax attention over the paged KV cache whose queries, keys and values come
from a recurrent projection (`CCAProjection`, transformers' `ZayaCCAProjection`).

    q, k = q_proj(x), k_proj(x)                   # (T, Hq D), (T, Hkv D)
    qk = convs([q | k])                           # depthwise (width K0), then grouped per head
    rq = (q + k of each query's KV head) / 2      # (T, Hq, D) the queries' residual
    rk = mean of rq over each KV head's queries   # (T, Hkv, D) the keys' residual
    query, key = qk's q part + rq, qk's k part + rk
    value = [v_proj_current(x) | v_proj_delayed(x) of the previous token]   # (T, Hkv D)
    query, key = sqrt(D) * query / |query|, sqrt(D) * key / |key| * temp    # per head
    out = o_proj(attention(rope(query), rope(key), value))

The value's first `Hkv D / 2` channels are the current token's, the rest the previous token's
delayed projection (so with two KV heads the first head is all current, the second all
delayed); a sequence's first token reads the delayed projection of a zero input (its bias).

Per sequence, the projection keeps a recurrent state (a `StatefulLayer`): the convs' input
history, `conv ((Hq + Hkv) D, K - 1)` (the last `K - 1 = K0 + K1 - 2` projected q and k), and
the last delayed projection, `value (Hkv D / 2,)`, both of kind `conv` (the model dtype); both
run through the `cca` op family (`vllm_mamba.ops.cca`) in the one recurrent step. The
attention keeps paged KV (`PagedAttention`, a `KVCacheLayer`: the keys after the norm and
RoPE), full or with a sliding window; the engine finds both by type.

Checkpoint names (transformers'): `qkv_proj.{q_proj, k_proj, v_proj_current, v_proj_delayed,
conv_qk_depthwise, conv_qk_grouped}`, `qk_norm.temp (Hkv,)`, `o_proj`; the projections and
`o_proj` have biases with `attention_bias`, the convs always.

Tensor parallelism (`tp`): each rank holds `Hq / N` query heads and `Hkv / N` KV heads (the
key residual averages a KV head's queries, so `Hkv` must be a multiple of N): its rows of
`q_proj` and `k_proj`, its heads' conv channels and `temp`, its input columns of `o_proj`
(row-parallel). The two value projections (together one KV head's worth per two heads) are
replicated, each rank keeping its heads' channels of their concatenation.

Glossary: T tokens in the step, H hidden size, Hq query heads, Hkv KV heads, D head dim, K0 and
K1 the convs' widths (`cca_time0`, `cca_time1`), S state slots, N ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.attention import PagedAttention
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.mixer_base import Conv1dWeights
from vllm_mamba.layers.parallel_linear import column_linear, row_linear, shard_param
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.ops import cca as cca_ops
from vllm_mamba.ops.table import MambaOps


class GroupedConvWeights(nn.Module):
    """A grouped conv's parameters under the checkpoint's names: `weight (C, C / G, K)`,
    `bias (C,)`."""

    def __init__(self, channels: int, per_group: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, per_group, kernel))
        self.bias = nn.Parameter(torch.empty(channels))


class CCAProjection(StatefulLayer):
    """`x (T, H)` -> query `(T, Hq, D)`, key and value `(T, Hkv, D)` (see the module
    docstring), advancing each sequence's `conv` and `value` states in place."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kernels: tuple[int, int],
        bias: bool,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        if min(kernels) < 1 or sum(kernels) < 3:
            raise ValueError(f"cca_time0 and cca_time1 must be >= 1, one of them > 1: {kernels}")
        if num_heads % num_kv_heads or (num_kv_heads * head_dim) % 2:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                f"({num_kv_heads}), whose channels ({num_kv_heads * head_dim}) must be even"
            )
        h0, heads = tp.range(num_heads, "num_attention_heads")  # this rank's
        k0, kv_heads = tp.range(num_kv_heads, "num_key_value_heads")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.channels = (heads + kv_heads) * head_dim
        self.history = sum(kernels) - 2  # K - 1
        self.kv_slice = slice(k0 * head_dim, (k0 + kv_heads) * head_dim)
        self.cca = ops.family(cca_ops.FAMILY)
        self.q_proj = column_linear(hidden_size, [num_heads * head_dim], bias, ops, tp)
        self.k_proj = column_linear(hidden_size, [num_kv_heads * head_dim], bias, ops, tp)
        half = num_kv_heads * head_dim // 2
        self.v_proj_current = Linear(hidden_size, half, bias, ops)
        self.v_proj_delayed = Linear(hidden_size, half, bias, ops)
        self.conv_qk_depthwise = Conv1dWeights(self.channels, kernels[0], True)
        self.conv_qk_grouped = GroupedConvWeights(self.channels, head_dim, kernels[1])
        if tp.size > 1:
            total = (num_heads + num_kv_heads) * head_dim
            ranges = [(h0 * head_dim, heads * head_dim),
                      ((num_heads + k0) * head_dim, kv_heads * head_dim)]  # fmt: skip
            for conv in (self.conv_qk_depthwise, self.conv_qk_grouped):
                shard_param(conv, "weight", 0, ranges, total)
                shard_param(conv, "bias", 0, ranges, total)
        self.register_buffer("dw_weight", torch.empty(0), persistent=False)

    def process_weights_after_loading(self) -> None:
        """The depthwise filters as `(C, K0)`."""
        self.dw_weight = self.conv_qk_depthwise.weight.detach()[:, 0, :].contiguous()

    def state_spec(self) -> StateSpec:
        """The convs' input history `(C, K - 1)` and the last delayed value `(Hkv D / 2,)`."""
        return StateSpec(
            (
                StateTensor("conv", (self.channels, self.history), "conv"),
                StateTensor("value", (self.v_proj_delayed.out_features,), "conv"),
            )
        )

    def _convs(self, qk: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """Both convs over `qk (T, C)` from each sequence's history -> `(T, C)`."""
        states = self.state["conv"]
        dw_bias = self.conv_qk_depthwise.bias
        grouped = self.conv_qk_grouped
        return recurrent_step(
            meta, [states],
            decode=lambda r, slots: self.cca.conv_update(
                qk[r], states, self.dw_weight, dw_bias, grouped.weight, grouped.bias, slots
            ),
            prefill=lambda r: self.cca.conv_varlen(
                qk[r], self.dw_weight, dw_bias, grouped.weight, grouped.bias, states,
                meta.prefill_query_start_loc, meta.prefill_state_indices,
                meta.prefill_has_initial_state,
            ),
        )  # fmt: skip

    def _value(self, x: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """`[current | previous token's delayed]` projections of `x (T, H)`: this rank's KV
        heads' channels `(T, Hkv D)`."""
        delayed = self.v_proj_delayed(x)  # (T, Hkv D / 2), all heads'
        states = self.state["value"]
        previous = recurrent_step(
            meta, [states],
            decode=lambda r, slots: self.cca.shift_update(delayed[r], states, slots),
            prefill=lambda r: self.cca.shift_varlen(
                delayed[r], states, self.v_proj_delayed.bias, meta.prefill_query_start_loc,
                meta.prefill_state_indices, meta.prefill_has_initial_state,
            ),
        )  # fmt: skip
        return torch.cat([self.v_proj_current(x), previous], dim=-1)[:, self.kv_slice]

    def forward(
        self, x: torch.Tensor, meta: PagedMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x (T, H)` -> query `(T, Hq, D)`, key `(T, Hkv, D)`, value `(T, Hkv, D)`."""
        rows, dim = x.shape[0], self.head_dim
        q, k = self.q_proj(x), self.k_proj(x)  # (T, Hq D), (T, Hkv D)
        mixed = self._convs(torch.cat([q, k], dim=-1), meta)  # (T, C)
        group = self.heads // self.kv_heads
        q_res = (q.view(rows, -1, dim) + k.view(rows, -1, dim).repeat_interleave(group, 1)) * 0.5
        k_res = q_res.view(rows, self.kv_heads, group, dim).mean(dim=2)  # (T, Hkv, D)
        split = self.heads * dim
        query = mixed[:, :split].view(rows, -1, dim) + q_res
        key = mixed[:, split:].view(rows, -1, dim) + k_res
        return query, key, self._value(x, meta).view(rows, -1, dim)


class QKNorm(nn.Module):
    """Queries and keys scaled to norm `sqrt(D)` per head, the keys then by `temp (Hkv,)`."""

    def __init__(self, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.temp = nn.Parameter(torch.empty(kv_heads))
        self.scale = head_dim**0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`q (T, Hq, D)`, `k (T, Hkv, D)` -> normed, in their shapes."""
        eps = torch.finfo(q.dtype).eps
        q = q * (self.scale / q.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        k = k * (self.scale / k.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        return q, k * self.temp[None, :, None]


class CCAttention(nn.Module):
    """`o_proj(attention(rope(qk_norm(qkv_proj(x)))))` (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        kernels: tuple[int, int],
        bias: bool,
        rotary: RotaryEmbedding,
        ops: MambaOps,
        sliding_window: int | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.qkv_proj = CCAProjection(
            hidden_size, num_heads, num_kv_heads, head_dim, kernels, bias, ops, tp
        )
        heads, kv_heads = self.qkv_proj.heads, self.qkv_proj.kv_heads
        self.qk_norm = QKNorm(kv_heads, head_dim)
        if tp.size > 1:
            heads_range = [tp.range(num_kv_heads, "num_key_value_heads")]
            shard_param(self.qk_norm, "temp", 0, heads_range, num_kv_heads)
        self.o_proj = row_linear(num_heads * head_dim, hidden_size, bias, ops, tp)
        self.rotary = rotary
        self.attn = PagedAttention(heads, kv_heads, head_dim, head_dim**-0.5, ops, sliding_window)

    def forward(self, hidden: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`."""
        query, key, value = self.qkv_proj(hidden, meta)
        query, key = self.qk_norm(query, key)
        q, k = self.rotary(meta.rope_positions, query.flatten(1), key.flatten(1), meta)
        return self.o_proj(self.attn(q, k, value.flatten(1), meta))
