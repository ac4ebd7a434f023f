"""`SelfAttention`: the projections, optional rotary embedding and paged attention of one
attention layer of a hybrid (Bamba, Granite 4.0-H, Nemotron-H, Falcon-H1, Qwen3.5, Qwen3-Next,
OLMo Hybrid).

Names are transformers' (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `q_norm`, `k_norm`), so the
checkpoints load as an identity mapping. GQA/MQA by `num_kv_heads`; the softmax scale is the
config's (`head_dim ** -0.5`, or Granite's `attention_multiplier`); `key_multiplier` scales the
keys (Falcon-H1). Options:

- `output_gate` (Qwen3.5 / Qwen3-Next): `q_proj` yields `[query D | gate D]` per head and the
  output is `o_proj(attention * sigmoid(gate))`.
- `q_norm` / `k_norm`: norms of the queries and keys before the rotary embedding, per head
  (`qk_norm_per_head`, Qwen's zero-centred `(D,)` norms) or over the whole projection (OLMo
  Hybrid's `(Hq D,)` and `(Hkv D,)`; under tensor parallelism a norm that all-reduces its
  statistics).

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
        output_gate: bool = False,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        qk_norm_per_head: bool = True,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        heads = tp.split(num_heads, "num_attention_heads")  # this rank's
        kv_ranges, kv_heads = kv_head_ranges(num_kv_heads, head_dim, tp)
        kv_size = [num_kv_heads * head_dim]
        q_size = num_heads * head_dim * (2 if output_gate else 1)
        self.q_proj = column_linear(hidden_size, [q_size], bias, ops, tp)
        self.k_proj = column_linear(hidden_size, kv_size, bias, ops, tp, kv_ranges)
        self.v_proj = column_linear(hidden_size, kv_size, bias, ops, tp, kv_ranges)
        out_bias = bias if out_bias is None else out_bias
        self.o_proj = row_linear(num_heads * head_dim, hidden_size, out_bias, ops, tp)
        self.rotary = rotary
        self.key_multiplier = key_multiplier
        self.output_gate = output_gate
        self.head_dim = head_dim
        self.qk_norm_per_head = qk_norm_per_head
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm come together")
        self.q_norm, self.k_norm = q_norm, k_norm
        self.attn = PagedAttention(heads, kv_heads, head_dim, scale, ops)

    def forward(self, hidden: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`."""
        num_tokens = hidden.shape[0]
        q, gate = self.q_proj(hidden), None
        if self.output_gate:
            qg = q.view(num_tokens, -1, 2 * self.head_dim)  # (T, Hq, 2 D): [query | gate]
            q = qg[..., : self.head_dim].reshape(num_tokens, -1)  # (T, Hq D)
            gate = qg[..., self.head_dim :].reshape(num_tokens, -1)  # (T, Hq D)
        k, v = self.k_proj(hidden), self.v_proj(hidden)
        if self.q_norm is not None:
            q, k = self._norm(self.q_norm, q), self._norm(self.k_norm, k)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        if self.rotary is not None:
            q, k = self.rotary(meta.positions, q, k, meta)
        out = self.attn(q, k, v, meta)  # (T, Hq D)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`norm` of `x (T, heads D)`, per head or over the whole row."""
        if not self.qk_norm_per_head:
            return norm(x)
        return norm(x.view(x.shape[0], -1, self.head_dim)).reshape(x.shape)
