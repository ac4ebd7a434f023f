"""`PagedAttention`: the attention of one layer over the paged KV cache, for one flat batch.

The layer caches the step's keys and values at their slots, then runs paged decode attention
for the decode rows and causal varlen attention for the prefill chunks (which read their
cached context, so chunked prefill equals whole prefill). GQA/MQA by `num_kv_heads`; a
`sliding_window` of W tokens limits each query at position p to the keys at `(p - W, p]`
(transformers' `kv_idx > q_idx - sliding_window`), and its `AttentionSpec` says so, so the
engine frees the blocks every window has passed; no rotary here (a model that has it rotates
queries and keys first). A model may add two score terms (the Inkling families): a bias by
backward distance `rel (T, Hq, E)` and sink logits `sinks (T, Hq)` (see
`vllm_mamba.ops.paged_attention`). The kernels come from the
ops table; the layer's K/V views are bound once by the engine (`KVCache.bind`).

Glossary: T tokens in the step, Hq query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import torch

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.layers.cache_layers import KVCacheLayer, LayerKV
from vllm_mamba.ops.table import MambaOps


class PagedAttention(KVCacheLayer):
    """Attention of one layer; no parameters (the projections belong to the model)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        ops: MambaOps,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                f"({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.ops = ops
        self.sliding_window = sliding_window or 0  # 0: full attention (the kernels' convention)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: PagedMetadata,
        rel: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`q (T, Hq * D)`, `k`, `v (T, Hkv * D)` (or split into heads) -> `(T, Hq * D)` in
        q's dtype; `rel (T, Hq, E)` and `sinks (T, Hq)` are the optional score terms."""
        assert isinstance(self.kv, LayerKV), "the KV cache is not bound to this layer"
        num_tokens = q.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)

        def terms(rows: slice) -> dict[str, torch.Tensor]:
            """The score terms of the rows, as keywords (none when absent: backends without
            them keep working for every other model)."""
            given = {"rel": rel, "sinks": sinks}
            return {name: t[rows] for name, t in given.items() if t is not None}

        caches = {"k_cache": self.kv.k, "v_cache": self.kv.v}
        view = meta.kv_view(self.kv.group)  # this layer's KV group's slots and tables
        self.ops.reshape_and_cache(key=k, value=v, slot_mapping=view.slot_mapping, **caches)
        nd = meta.num_decodes
        parts = []
        if nd:
            parts.append(
                self.ops.paged_decode_attention(
                    query=q[:nd], block_tables=view.decode_block_tables,
                    seq_lens=meta.decode_seq_lens, scale=self.scale,
                    sliding_window=self.sliding_window, **caches, **terms(slice(nd)),
                )
            )  # fmt: skip
        if meta.num_prefills:
            parts.append(
                self.ops.paged_prefill_attention(
                    query=q[nd:], block_tables=view.prefill_block_tables,
                    query_start_loc=meta.prefill_query_start_loc,
                    seq_lens=meta.prefill_seq_lens, scale=self.scale,
                    sliding_window=self.sliding_window, **caches, **terms(slice(nd, None)),
                )
            )  # fmt: skip
        out = parts[0] if len(parts) == 1 else torch.cat(parts)  # (T, Hq, D)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
