"""`SelfAttention`: the projections, optional rotary embedding and paged attention of one
attention layer of a hybrid (Bamba, Granite 4.0-H, Nemotron-H, Falcon-H1, Qwen3.5, Qwen3-Next,
OLMo Hybrid).

Names are transformers' (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `q_norm`, `k_norm`), so the
checkpoints load as an identity mapping. GQA/MQA by `num_kv_heads`; the softmax scale is the
config's (`head_dim ** -0.5`, or Granite's `attention_multiplier`); `key_multiplier` scales the
keys (Falcon-H1). Options:

- `output_gate` (Qwen3.5 / Qwen3-Next): `q_proj` yields `[query D | gate D]` per head and the
  output is `o_proj(attention * sigmoid(gate))`.
- `head_gate` (LFM3): one gate per head, `g_proj (Hq, H)`, and the output is
  `o_proj(attention * sigmoid(g_proj(x)))` with each head's values scaled by its gate.
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

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.attention import PagedAttention
from vllm_mamba.layers.cache_layers import LayerKV
from vllm_mamba.layers.decode_plan import CHAIN_MAX_ROWS, FusedStep, decode_only
from vllm_mamba.layers.fused_decode_layer import _f32 as f32
from vllm_mamba.layers.fused_decode_layer import _out_dtype as fused_out_dtype
from vllm_mamba.layers.fused_decode_layer import _weights as fused_weights
from vllm_mamba.layers.fused_decode_layer import norm_weight, step_out_dtype
from vllm_mamba.layers.mixer_sharding import kv_head_ranges
from vllm_mamba.layers.parallel_linear import column_linear, row_linear
from vllm_mamba.layers.quantization import uses_int_dot
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.layers.rowwise import rowwise
from vllm_mamba.ops.families import own_op
from vllm_mamba.ops.paged_attention import AttentionParams
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
        sliding_window: int | None = None,
        head_gate: bool = False,
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
        self.attn = PagedAttention(heads, kv_heads, head_dim, scale, ops, sliding_window)
        self.ops = ops
        self.g_proj = column_linear(hidden_size, [num_heads], False, ops, tp) if head_gate else None

    def fused_mixer_step(
        self, norm: nn.Module | None, residual_in_fp32: bool, residual_scale: float = 1.0
    ) -> FusedStep | None:
        """The decode-only steps as one call of `paged_attention.decode_layer` (with the
        block's norm and residual, scaled by `residual_scale`, when given), planned once; None
        where it does not apply: no kernel, a norm or q/k norm that is not a plain or
        zero-centred `RMSNorm` per head, a RoPE that follows the sequence's length (`dynamic`,
        `longrope`), projections that are not plain `Linear`s of one model dtype
        (tensor-parallel layers are not), a float32 residual."""
        op = own_op("paged_attention", self.ops.name, "decode_layer")
        if op is None or residual_in_fp32 or (norm is not None and norm_weight(norm) is None):
            return None
        if self.g_proj is not None:
            return None  # the kernel has no per-head gate
        if self.q_norm is not None and not self.qk_norm_per_head:
            return None
        qk_norms = [norm_weight(n) for n in (self.q_norm, self.k_norm) if n is not None]
        if (
            any(w is None for w in qk_norms)
            or len({n.variance_epsilon for n in (self.q_norm, self.k_norm) if n}) > 1
        ):
            return None  # fmt: skip
        if self.rotary is not None and (
            self.rotary.freqs.by_length is not None or self.rotary.interleaved
        ):
            return None  # the kernel rotates NeoX pairs at fixed frequencies
        found = fused_weights(self, ("q_proj", "k_proj", "v_proj", "o_proj"))
        if found is None:
            return None
        weights, dtype = found
        params = AttentionParams(
            norm_w=norm_weight(norm) if norm is not None else None,
            q_proj_b=f32(self.q_proj.bias), k_proj_b=f32(self.k_proj.bias),
            v_proj_b=f32(self.v_proj.bias), o_proj_b=f32(self.o_proj.bias),
            q_norm_w=qk_norms[0] if qk_norms else None,
            k_norm_w=qk_norms[1] if qk_norms else None, **weights,
        )  # fmt: skip
        args = (
            self.attn.num_heads, self.attn.num_kv_heads, self.head_dim, self.output_gate,
            self.attn.scale, self.key_multiplier,
            norm.variance_epsilon if norm is not None else 0.0,
            self.q_norm.variance_epsilon if self.q_norm is not None else 0.0,
        )  # fmt: skip
        return FusedAttentionStep(
            op, self, list(params), args, dtype, fused_out_dtype(dtype, norm, False),
            residual_scale=float(residual_scale) if norm is not None else 1.0,
        )  # fmt: skip

    def forward(self, hidden: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`."""
        num_tokens = hidden.shape[0]
        q, gate, k, v = self._project(hidden, meta)
        out = self.attn(q, k, v, meta)  # (T, Hq D)
        if gate is not None:
            out = out * rowwise(torch.sigmoid, gate)  # each row as alone
        if self.g_proj is not None:
            heads = rowwise(torch.sigmoid, self.g_proj(hidden))  # (T, Hq)
            out = (out.view(num_tokens, -1, self.head_dim) * heads[..., None]).flatten(1)
        return self.o_proj(out)

    def _project(
        self, hidden: torch.Tensor, meta: PagedMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """`hidden (T, H)` -> the normed, scaled and rotated `q (T, Hq D)`, the output gate
        `(T, Hq D)` (None without one), `k` and `v (T, Hkv D)`."""
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
            q, k = self.rotary(meta.rope_positions, q, k, meta)
        return q, gate, k, v

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`norm` of `x (T, heads D)`, per head or over the whole row."""
        if not self.qk_norm_per_head:
            return norm(x)
        return norm(x.view(x.shape[0], -1, self.head_dim)).reshape(x.shape)


@dataclass(frozen=True, eq=False)
class FusedAttentionStep:
    """A `SelfAttention`'s decode-only step in one call of `op` (`decode_layer`), with the
    block's norm and residual (scaled by `residual_scale`) when planned with one. `args`:
    heads, kv heads, head dim, output gate, scale, key multiplier, norm and q/k norm epsilons.
    The KV views and the RoPE table are read per call (bound and grown after planning)."""

    op: Callable[..., torch.Tensor]
    attention: SelfAttention
    params: list[torch.Tensor | None]
    args: tuple[int | float | bool, ...]
    dtype: torch.dtype
    out_dtype: torch.dtype | None
    residual_scale: float = field(default=1.0, kw_only=True)

    def takes(self, hidden: torch.Tensor, meta: PagedMetadata) -> bool:
        """A decode-only step (see `decode_plan.decode_only`; the chains' rows attend as the
        unfused layer's do: every key written first)."""
        if meta.mrope_positions is not None:  # image tokens of an M-RoPE model
            return False
        return decode_only(hidden, meta, None, CHAIN_MAX_ROWS)

    def __call__(self, hidden: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`; the rows' keys and values written into the cache."""
        out_dtype = step_out_dtype(self.out_dtype, self.dtype, hidden)
        attn = self.attention
        kv = attn.attn.kv
        assert isinstance(kv, LayerKV), "the KV cache is not bound to this layer"
        rotary = attn.rotary
        table = rotary.table(meta.rope_positions) if rotary is not None else None
        rows = meta.rope_positions if rotary is not None else None
        view = meta.kv_view(kv.group)
        return self.op(
            hidden, self.params, kv.k, kv.v, view.slot_mapping, view.decode_block_tables,
            meta.decode_seq_lens, table, rows, *self.args, out_dtype, uses_int_dot(attn.q_proj),
            bool(meta.decode_waves), attn.attn.sliding_window, self.residual_scale,
        )  # fmt: skip
