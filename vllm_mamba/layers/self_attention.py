"""`SelfAttention`: the projections, optional rotary embedding and paged attention of one
attention layer of a hybrid (Bamba, Granite 4.0-H, Nemotron-H, Falcon-H1).

Names are transformers' (`q_proj`, `k_proj`, `v_proj`, `o_proj`), so the checkpoints load as an
identity mapping. GQA/MQA by `num_kv_heads`; the softmax scale is the config's
(`head_dim ** -0.5`, or Granite's `attention_multiplier`); `key_multiplier` scales the keys
(Falcon-H1).

With tensor parallelism (`tp`) each rank holds `Hq / tp.size` query heads and their key/value
heads (split when `Hkv` is a multiple of the ranks, else the one each rank's queries read,
replicated); `o_proj` is row-parallel.

Glossary: T tokens in the step, H hidden size, Hq query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.attention import PagedAttention
from vllm_mamba.layers.mixer_sharding import kv_head_ranges
from vllm_mamba.layers.parallel_linear import column_linear, row_linear
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.ops.table import MambaOps


class SelfAttention(nn.Module):
    """`o_proj(attention(rope(q_proj(x)), rope(k_proj(x)) * key_multiplier, v_proj(x)))`."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool,
        scale: float,
        rotary: RotaryEmbedding | None,
        ops: MambaOps,
        out_bias: bool | None = None,
        key_multiplier: float = 1.0,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        heads = tp.split(num_heads, "num_attention_heads")  # this rank's
        kv_ranges, kv_heads = kv_head_ranges(num_kv_heads, head_dim, tp)
        kv_size = [num_kv_heads * head_dim]
        self.q_proj = column_linear(hidden_size, [num_heads * head_dim], bias, ops, tp)
        self.k_proj = column_linear(hidden_size, kv_size, bias, ops, tp, kv_ranges)
        self.v_proj = column_linear(hidden_size, kv_size, bias, ops, tp, kv_ranges)
        out_bias = bias if out_bias is None else out_bias
        self.o_proj = row_linear(num_heads * head_dim, hidden_size, out_bias, ops, tp)
        self.rotary = rotary
        self.key_multiplier = key_multiplier
        self.attn = PagedAttention(heads, kv_heads, head_dim, scale, ops)

    def forward(self, hidden: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`."""
        q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        if self.rotary is not None:
            q, k = self.rotary(meta.positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))
