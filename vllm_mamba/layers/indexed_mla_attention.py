"""`IndexedMLAAttention`: MLA whose queries attend only to the tokens a sparse-attention indexer
selects (GLM-5-Next's DSA layers).

A "full" layer owns a `PoolIndexer` (`indexer.*`, `layers.pool_indexer`): it writes the
indexer's keys beside its latents (`MLASpec.indexer`) and selects `(T, W)` token positions per
query; a "shared" layer has no indexer and reuses the selection of the full layer before it in
the same step (`share_from`, GLM's cross-layer top-k sharing). The attention over the selected
tokens is MLA's with the causal mask replaced by the selection:

- decode rows: the family's absorbed decode kernel reads the selected latents (ascending
  positions) through a block table of one-token blocks (`layers.block_indexer.selected_slots`),
  so a decode step reads `W` latents whatever the context (`_sparse`);
- prefill chunks: expanded attention with the selection as mask (transformers' form), or for
  a sequence too long to expand (`expand_max_bytes`) every query as a decode row of that
  kind.

Everything else (projections, latents, tensor parallelism) is `MLAAttention`'s.

Glossary: T tokens, Q a chunk's queries, W the selection width, L the latent dim.
"""

from __future__ import annotations

import torch

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.cache_specs import KVSpec, MLASpec
from vllm_mamba.layers.block_indexer import (
    one_token_blocks,
    select_step,
    selected_slots,
    selection_mask,
)
from vllm_mamba.layers.cache_layers import LatentKV
from vllm_mamba.layers.mla_attention import MLAAttention
from vllm_mamba.layers.pool_indexer import PoolIndexer


class IndexedMLAAttention(MLAAttention):
    """MLA over the tokens an indexer selects (see the module docstring)."""

    def __init__(self, *args: object, indexer: PoolIndexer | None, **kwargs: object) -> None:
        """Args: `MLAAttention`'s; `indexer` this layer's indexer, or None for a shared layer
        (then `share_from` must name its source before the first step)."""
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.indexer = indexer
        self._source: list[IndexedMLAAttention] = []  # a shared layer's (not a submodule)
        self.selection: torch.Tensor | None = None  # (T, W) of the current step

    def share_from(self, source: IndexedMLAAttention) -> None:
        """Makes this (shared) layer reuse `source`'s selection.

        Raises:
            ValueError: this layer has its own indexer, or `source` has none.
        """
        if self.indexer is not None or source.indexer is None:
            raise ValueError("a shared DSA layer reuses the selection of a full indexer layer")
        self._source = [source]

    def kv_spec(self, dtype: torch.dtype) -> KVSpec:
        """The latent row per token and, for a full layer, the indexer's keys beside it."""
        if self.indexer is None:
            return MLASpec(self.latent_dim, dtype)
        index = self.indexer.cache_spec(dtype)
        return MLASpec(self.latent_dim, dtype, indexer=index)

    def forward(self, hidden: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`."""
        q_nope, q_rot, q_resid = self._queries(hidden, meta)
        selection = self._select(hidden, q_resid, meta)  # (T, W)
        self.selection = selection
        nd, parts = meta.num_decodes, []
        if nd:
            live = meta.decode_seq_lens > 0  # padding rows read nothing
            parts.append(
                self._sparse(
                    q_nope[:nd], q_rot[:nd], selection[:nd], meta.decode_block_tables, live
                )
            )
        if meta.num_prefills:
            parts.append(self._prefill_sparse(q_nope[nd:], q_rot[nd:], selection[nd:], meta))
        return self._output(parts, hidden)

    def _select(
        self, hidden: torch.Tensor, q_resid: torch.Tensor | None, meta: PagedMetadata
    ) -> torch.Tensor:
        """Writes the indexer's keys and selects `(T, W)` positions per token (a shared layer:
        its source's selection of this step)."""
        if self.indexer is None:
            assert self._source, "a shared DSA layer needs its source (share_from)"
            selection = self._source[0].selection
            assert selection is not None and selection.shape[0] == hidden.shape[0]
            return selection
        assert isinstance(self.kv, LatentKV) and self.kv.index_rows is not None
        assert q_resid is not None, "DSA needs the low-rank query (q_lora_rank)"
        index, pooled = self.indexer, self.kv.pooled
        rows = index.rows(hidden)
        index.write(rows, self.kv.index_rows, pooled, meta.slot_mapping, meta.positions)
        return select_step(index, hidden, q_resid, pooled, meta)

    def _sparse(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, selection: torch.Tensor,
        tables: torch.Tensor, live: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Absorbed attention of `N` queries over their selected latents, read through a block
        table of one-token blocks -> `(N, Hq, Dv)` float32.

        Args:
            q_nope, q_rot: `(N, Hq, Dn)`, `(N, Hq, Dr)`.
            selection: `(N, W)` positions, `-1` padded.
            tables: `(N or 1, max_blocks)` the queries' block tables.
            live: `(N,)` rows that attend (padding rows do not); default all.
        """
        assert isinstance(self.kv, LatentKV)
        latent = self.kv.latent
        slots, counts = selected_slots(selection, tables, latent.shape[1])  # (N, W), (N,)
        if live is not None:
            counts = counts * live
        return self._absorbed(
            q_nope, q_rot, self.mla.decode_attention, cache=one_token_blocks(latent),
            block_tables=slots, seq_lens=counts,
        )  # fmt: skip

    def _prefill_sparse(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, selection: torch.Tensor,
        meta: PagedMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """The prefill chunks' attention over their selections -> `(Tp, Hq, Dv)` float32."""
        out = torch.zeros(q_nope.shape[0], self.num_heads, self.v_head_dim, device=q_nope.device)
        for p, begin, end, length, expandable in self._prefill_spans(meta):
            table, chosen = meta.prefill_block_tables[p], selection[begin:end]
            if expandable:
                out[begin:end] = self._expanded(
                    q_nope[begin:end], q_rot[begin:end], table, length,
                    selection_mask(chosen, length),
                )  # fmt: skip
            else:
                out[begin:end] = self._sparse(
                    q_nope[begin:end], q_rot[begin:end], chosen, table[None]
                )
        return out


__all__ = ["IndexedMLAAttention"]
