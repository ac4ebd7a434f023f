"""Qwen4-Exp's indexed attention (QSA): `QSAIndexer` picks the tokens each query reads,
`IndexedSelfAttention` attends over them.

The indexer (`indexer.*`, transformers' names), per token:

    [q | k] = index_qk_proj(x)                   q (Hi, D), k (D): one key head
    q = rope(q_layernorm(q), p)                  zero-centred RMSNorms, the attention's RoPE
                                                 on the first `rot_dim` dims of D

Blocks of `kpool` (`indexer_compress_ratio`) tokens: a complete block's key is the float mean
of its tokens' raw `k`, `k_layernorm`-ed and rotated at the block's first position; a query
scores it `sum_h relu(q_h . key) / sqrt(D)` and keeps the best `indexer_budget // kpool` and
its incomplete block (`layers.block_indexer`: the cache of raw keys and block keys, the
selection). The attention is Qwen3.5's gated attention (`layers.self_attention`) with the
causal mask replaced by the selection: the ops' paged decode kernel reads each decode row's
selected keys and values (ascending positions) through a block table of one-token blocks
(`layers.block_indexer.selected_slots`), so a decode step reads at most `W` keys whatever the
context. A prefill chunk whose sequence is at most `DENSE_FACTOR * W` tokens long attends
densely with the selection as mask (its sequence's keys and values read once, one SDPA: its
queries select most of them anyway); a longer one runs every query as a decode row of that
kind. Measured on a Zen 4, Qwen3.8-Flash-Next's shapes, bfloat16: a 512-token prompt whose
every query read its selection as a decode row prefilled at 222 tok/s, the dense form at 353.

Glossary: T tokens, Hi indexer heads, D indexer head dim, W selection width.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.cache_specs import AttentionSpec
from vllm_mamba.layers.attention import PagedAttention
from vllm_mamba.layers.block_indexer import (
    BlockIndexer,
    one_token_blocks,
    select_step,
    selected_slots,
    selection_mask,
)
from vllm_mamba.layers.cache_layers import LayerKV
from vllm_mamba.layers.layernorm import ZeroCenteredRMSNorm
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.layers.self_attention import SelfAttention
from vllm_mamba.ops.table import MambaOps

DENSE_FACTOR = 2  # a prefill chunk of a sequence up to this many selection widths: dense


class QSAIndexer(BlockIndexer):
    """Qwen4-Exp's block indexer (see the module docstring)."""

    def __init__(
        self, hidden_size: int, num_heads: int, head_dim: int, kpool: int, budget: int,
        eps: float, rotary: RotaryEmbedding, ops: MambaOps,
    ) -> None:  # fmt: skip
        """Args: `hidden_size` H; `num_heads` Hi; `head_dim` D; `kpool` the block size;
        `budget` the tokens of complete blocks a query keeps; `eps` the norms' epsilon;
        `rotary` the attention's RoPE over D-wide heads; `ops` the ops table. Replicated
        under tensor parallelism."""
        super().__init__(head_dim, head_dim, kpool, budget)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.index_qk_proj = Linear(hidden_size, (num_heads + 1) * head_dim, False, ops)
        self.q_layernorm = ZeroCenteredRMSNorm(head_dim, eps)
        self.k_layernorm = ZeroCenteredRMSNorm(head_dim, eps)
        self.rotary = rotary

    def project(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`x (T, H)` -> the rotated normed queries `(T, Hi, D)` and the raw keys `(T, D)`."""
        num_tokens, d = x.shape[0], self.head_dim
        q, k = self.index_qk_proj(x).split([self.num_heads * d, d], dim=-1)
        q = self.q_layernorm(q.reshape(num_tokens, self.num_heads, d)).reshape(num_tokens, -1)
        q, _ = self.rotary(positions, q, k.contiguous())
        return q.view(num_tokens, self.num_heads, d), k

    def pool(self, group: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """The normed mean of each block's raw keys, rotated at its first position."""
        key = self.k_layernorm(group.float().mean(dim=1).to(group.dtype))  # (M, D)
        rotated, _ = self.rotary(starts, key, key)
        return rotated

    def score(
        self, x: torch.Tensor, query_input: torch.Tensor, positions: torch.Tensor,
        keys: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """`sum_h relu(q_h . k_j) / sqrt(D)`, `query_input` the rotated queries `(Q, Hi, D)`."""
        scores = F.relu(torch.matmul(query_input.float(), keys.transpose(1, 2)))  # (Q, Hi, P)
        return scores.sum(dim=1) / self.head_dim**0.5


class IndexedPagedAttention(PagedAttention):
    """The layer's KV blocks with its indexer's keys beside them (`AttentionSpec.indexer`);
    the attention itself is `IndexedSelfAttention`'s."""

    index: list[BlockIndexer]  # the layer's indexer (not a submodule of this one)

    def kv_spec(self, dtype: torch.dtype) -> AttentionSpec:
        """K and V of `Hkv x D` per token and the indexer's rows and pooled keys."""
        spec = self.index[0].cache_spec(dtype)
        return AttentionSpec(self.num_kv_heads, self.head_dim, dtype, indexer=spec)


class IndexedSelfAttention(SelfAttention):
    """Gated attention over the tokens its `QSAIndexer` selects (see the module docstring)."""

    def __init__(self, *args: Any, indexer: QSAIndexer, **kwargs: Any) -> None:
        """Args: `SelfAttention`'s, and the layer's `indexer`."""
        super().__init__(*args, **kwargs)
        self.indexer = indexer
        plain = self.attn
        self.attn = IndexedPagedAttention(
            plain.num_heads, plain.num_kv_heads, plain.head_dim, plain.scale, plain.ops
        )
        self.attn.index = [indexer]

    def fused_mixer_step(
        self, norm: Any, residual_in_fp32: bool, residual_scale: float = 1.0
    ) -> None:
        """None: the fused decode attends to the whole context."""
        return None

    def forward(self, hidden: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`."""
        kv = self.attn.kv
        assert isinstance(kv, LayerKV) and kv.index_rows is not None, "no indexed cache bound"
        q, gate, k, v = self._project(hidden, meta)
        index_q, index_k = self.indexer.project(hidden, meta.rope_positions)
        self.indexer.write(index_k, kv.index_rows, kv.pooled, meta.slot_mapping, meta.positions)
        selection = select_step(self.indexer, hidden, index_q, kv.pooled, meta)  # (T, W)
        out = self._attend(q, k, v, selection, meta)  # (T, Hq D)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: torch.Tensor,
        meta: PagedMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """Caches the step's keys and values, then every query attends over its selection."""
        attn, kv = self.attn, self.attn.kv
        assert isinstance(kv, LayerKV)
        heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        num_tokens = q.shape[0]
        q = q.reshape(num_tokens, heads, d)
        view = meta.kv_view(kv.group)
        attn.ops.reshape_and_cache(
            key=k.reshape(num_tokens, kv_heads, d), value=v.reshape(num_tokens, kv_heads, d),
            k_cache=kv.k, v_cache=kv.v, slot_mapping=view.slot_mapping,
        )  # fmt: skip
        out = q.new_zeros(num_tokens, heads, d)
        nd = meta.num_decodes
        rows = [(slice(0, nd), view.decode_block_tables, meta.decode_seq_lens > 0)] if nd else []
        starts, lengths = meta.prefill_query_start_loc.tolist(), meta.prefill_seq_lens.tolist()
        for p in range(meta.num_prefills):
            if starts[p + 1] == starts[p]:
                continue
            span, table = slice(nd + starts[p], nd + starts[p + 1]), view.prefill_block_tables[p]
            if lengths[p] <= DENSE_FACTOR * self.indexer.width:
                out[span] = self._masked(q[span], selection[span], table, lengths[p])
            else:
                rows.append((span, table[None], None))
        for span, tables, live in rows:
            out[span] = self._selected(q[span], selection[span], tables, live)
        return out.reshape(num_tokens, heads * d)

    def _masked(
        self, q: torch.Tensor, selection: torch.Tensor, table: torch.Tensor, length: int
    ) -> torch.Tensor:
        """One sequence's chunk `q (Q, Hq, D)` over its `length` cached keys and values, each
        query seeing only its selection -> `(Q, Hq, D)`."""
        attn, kv = self.attn, self.attn.kv
        assert isinstance(kv, LayerKV)
        pos = torch.arange(length, device=q.device)
        blocks, offsets = table[pos // kv.k.shape[1]].long(), pos % kv.k.shape[1]
        group = attn.num_heads // attn.num_kv_heads
        keys = kv.k[blocks, offsets].repeat_interleave(group, dim=1)  # (S, Hq, D)
        values = kv.v[blocks, offsets].repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1).to(q.dtype), values.transpose(0, 1).to(q.dtype),
            attn_mask=selection_mask(selection, length), scale=attn.scale,
        )  # fmt: skip
        return out.transpose(0, 1)

    def _selected(
        self, q: torch.Tensor, selection: torch.Tensor, tables: torch.Tensor,
        live: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """`q (N, Hq, D)` over their selected keys and values, read by the paged decode kernel
        through a block table of one-token blocks -> `(N, Hq, D)`."""
        attn, kv = self.attn, self.attn.kv
        assert isinstance(kv, LayerKV)
        slots, counts = selected_slots(selection, tables, kv.k.shape[1])  # (N, W), (N,)
        if live is not None:
            counts = counts * live
        return attn.ops.paged_decode_attention(
            query=q, k_cache=one_token_blocks(kv.k), v_cache=one_token_blocks(kv.v),
            block_tables=slots, seq_lens=counts, scale=attn.scale, sliding_window=0,
        )  # fmt: skip


__all__ = ["DENSE_FACTOR", "IndexedSelfAttention", "QSAIndexer"]
