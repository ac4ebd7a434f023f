"""`BlockIndexer`: the cache writes and the top-k selection every sparse-attention indexer that
scores pools of tokens shares (GLM-5-Next's DSA, `layers.pool_indexer`; Qwen4-Exp's QSA,
`layers.qsa_indexer`).

Tokens are grouped in pools of `kpool` from position 0. A query at position `p` sees the
`n = (p + 1) // kpool` pools complete by then; it scores their pooled keys (the subclass's
`score`), selects the best `topk // kpool` (all when fewer) and their tokens, and the
incomplete pool it is in (the "tail", `(p + 1) % kpool` tokens). A query whose own pool has just
completed sees it only if it is selected (transformers computes it so for both models).

The cache (`cache_specs.IndexerSpec`, beside the layer's keys and values): each token's row
(the subclass's `rows`) at its slot, and each complete pool's key (the subclass's `pool` of
its rows), computed when its last token is written (`write`), at index `slot // kpool` of the
flat pooled tensor (a pool never straddles a block). A speculative token written again
rewrites its row and its pool's key.

The selection (`select`) is `(T, W)` token positions per query, `-1` padded, `W = topk + kpool
- 1`. The attention reads it through a block table of one-token blocks (`selected_slots`,
`one_token_blocks`): each query's selected slots, so the layer's paged kernels (reference, C++
or Triton) read exactly those tokens, with no copy. Ties between pool scores (exactly equal
floats) are broken by `torch.topk`, as in transformers, which runs the same top-k over a
differently laid out score vector: a tie at the budget's edge may select another pool than
transformers does.

Glossary: T tokens, Q a group of queries, P pools, D the pooled key's dim, W selection width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.cache_specs import IndexerSpec


class BlockIndexer(nn.Module):
    """Pool bookkeeping, cache writes and top-k selection; subclasses give the math."""

    def __init__(self, row_dim: int, key_dim: int, kpool: int, topk: int) -> None:
        """Args: `row_dim` the cached row per token; `key_dim` D; `kpool` the pool size; `topk`
        the token budget, a multiple of `kpool`.

        Raises:
            ValueError: `topk` is not a positive multiple of `kpool`.
        """
        super().__init__()
        if kpool < 1 or topk < kpool or topk % kpool:
            raise ValueError(
                f"the indexer's budget ({topk}) must be a positive multiple of its pool or "
                f"block size ({kpool})"
            )
        self.row_dim, self.key_dim, self.kpool, self.topk = row_dim, key_dim, kpool, topk

    @property
    def width(self) -> int:
        """W: the selection's width (the budget and a tail)."""
        return self.topk + self.kpool - 1

    def cache_spec(self, dtype: torch.dtype) -> IndexerSpec:
        """The indexer's cache in `dtype`."""
        return IndexerSpec(self.row_dim, self.key_dim, self.kpool, dtype)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The tokens' cached rows `(T, row_dim)` from the layer input `x (T, H)`."""
        raise NotImplementedError

    def pool(self, group: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """Complete pools' rows `(M, kpool, row_dim)` starting at positions `starts (M,)` ->
        their keys `(M, D)`."""
        raise NotImplementedError

    def score(
        self, x: torch.Tensor, query_input: torch.Tensor, positions: torch.Tensor,
        keys: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The scores `(Q, P)` of pooled `keys (Q or 1, P, D)` for the queries at `positions
        (Q,)`, from their layer input `x (Q, H)` and `query_input` (the subclass's)."""
        raise NotImplementedError

    def write(
        self, new_rows: torch.Tensor, rows: torch.Tensor, pooled: torch.Tensor,
        slots: torch.Tensor, positions: torch.Tensor,
    ) -> None:  # fmt: skip
        """Writes the tokens' rows and the keys of the pools they complete.

        Args:
            new_rows: `(T, row_dim)` the tokens' rows (`rows` of the layer input, or the
                subclass's own projection of it).
            rows: `(NB, BS, row_dim)` the indexer rows of the pool.
            pooled: `(NB, BS // kpool, D)` the pooled keys.
            slots: `(T,)` each token's slot (`< 0`: padding, skipped).
            positions: `(T,)` each token's position in its sequence.
        """
        slots, valid = slots.long(), slots >= 0
        flat = rows.view(-1, rows.shape[-1])  # (NB BS, row_dim)
        flat[slots[valid]] = new_rows[valid].to(rows.dtype)
        ends = valid & ((positions.long() + 1) % self.kpool == 0)  # tokens completing a pool
        if not bool(ends.any()):
            return
        last = slots[ends]  # (M,)
        members = last[:, None] - torch.arange(self.kpool - 1, -1, -1, device=last.device)
        starts = positions.long()[ends] - (self.kpool - 1)
        keys = self.pool(flat[members], starts)  # (M, D)
        pooled.view(-1, self.key_dim)[last // self.kpool] = keys.to(pooled.dtype)

    def select(
        self, x: torch.Tensor, query_input: torch.Tensor, pooled: torch.Tensor,
        tables: torch.Tensor, positions: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The tokens each query attends to.

        Args:
            x: `(Q, H)` the queries' layer input.
            query_input: `(Q, ...)` what `score` reads besides `x`.
            pooled: `(NB, BS // kpool, D)` the pooled keys.
            tables: `(Q or 1, max_blocks)` the queries' block tables (1: one sequence's).
            positions: `(Q,)` each query's position.

        Returns:
            `(Q, W)` int64 token positions, `-1` padded.
        """
        num_q, kpool, device = x.shape[0], self.kpool, x.device
        positions = positions.long()
        seen = (positions + 1) // kpool  # (Q,) complete pools visible
        num_pools = int(seen.max()) if num_q else 0
        picks = torch.full((num_q, 0), -1, dtype=torch.long, device=device)
        if num_pools:
            block_size = pooled.shape[1] * kpool
            starts = torch.arange(num_pools, device=device) * kpool  # (P,)
            blocks = tables.long()[:, starts // block_size]  # (Q or 1, P)
            index = (blocks * block_size + starts % block_size) // kpool
            keys = pooled.view(-1, self.key_dim)[index].float()  # (Q or 1, P, D)
            score = self.score(x, query_input, positions, keys)  # (Q, P)
            visible = torch.arange(num_pools, device=device) < seen[:, None]  # (Q, P)
            score = score.masked_fill(~visible, torch.finfo(score.dtype).min)
            chosen = score.topk(min(self.topk // kpool, num_pools), dim=-1).indices  # (Q, K)
            kept = visible.gather(1, chosen)
            offsets = torch.arange(kpool, device=device)
            picks = (chosen[..., None] * kpool + offsets).flatten(1)  # (Q, K kpool)
            picks = picks.masked_fill(~kept.repeat_interleave(kpool, dim=1), -1)
        tail_len = (positions + 1) % kpool  # (Q,)
        tail_offsets = torch.arange(kpool - 1, device=device)
        tail = seen[:, None] * kpool + tail_offsets  # (Q, kpool - 1)
        tail = tail.masked_fill(tail_offsets >= tail_len[:, None], -1)
        chosen_all = torch.cat([picks, tail], dim=-1)
        return F.pad(chosen_all, (0, self.width - chosen_all.shape[1]), value=-1)


def select_step(
    indexer: BlockIndexer, x: torch.Tensor, query_input: torch.Tensor, pooled: torch.Tensor,
    meta: PagedMetadata,
) -> torch.Tensor:  # fmt: skip
    """The selections `(T, W)` of a step's tokens: the decode rows with their own block tables
    at once, each prefill chunk with its sequence's; padding tokens past the chunks select
    nothing."""
    nd, parts = meta.num_decodes, []
    if nd:
        parts.append(
            indexer.select(
                x[:nd], query_input[:nd], pooled, meta.decode_block_tables, meta.positions[:nd]
            )
        )
    starts = meta.prefill_query_start_loc.tolist()
    for p in range(meta.num_prefills):
        begin, end = nd + starts[p], nd + starts[p + 1]
        if end > begin:
            table = meta.prefill_block_tables[p : p + 1]  # (1, max_blocks): all its queries
            parts.append(
                indexer.select(
                    x[begin:end], query_input[begin:end], pooled, table, meta.positions[begin:end]
                )
            )
    width, num_tokens = indexer.width, x.shape[0]
    selection = torch.cat(parts) if parts else x.new_full((0, width), -1, dtype=torch.long)
    if selection.shape[0] < num_tokens:
        pad = selection.new_full((num_tokens - selection.shape[0], width), -1)
        selection = torch.cat([selection, pad])
    return selection


def selected_slots(
    selection: torch.Tensor, tables: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's selected cache slots, in ascending positions, packed at the front: the
    block table of a cache viewed as blocks of one token (`(NB BS, 1, ...)`), so a paged
    attention kernel reads exactly the selected tokens through it (no copy).

    Args:
        selection: `(N, W)` positions, `-1` padded.
        tables: `(N or 1, max_blocks)` the queries' block tables.
        block_size: tokens per block of the cache.

    Returns:
        `(slots (N, W) int32, counts (N,) int32)`: the slots past a query's count are filler.
    """
    num = selection.shape[0]
    valid = selection >= 0
    far = torch.iinfo(torch.int64).max
    ordered = torch.where(valid, selection, far).sort(dim=1).values  # valid first
    pos = torch.where(ordered == far, 0, ordered)
    blocks = tables.long().expand(num, -1).gather(1, pos // block_size)
    slots = blocks * block_size + pos % block_size
    return slots.to(torch.int32), valid.sum(dim=1).to(torch.int32)


def selection_mask(selection: torch.Tensor, length: int) -> torch.Tensor:
    """The keys each query sees: `(Q, length)` bool from `selection (Q, W)` (`-1` padded)."""
    allowed = torch.zeros(selection.shape[0], length + 1, dtype=torch.bool, device=selection.device)
    allowed.scatter_(1, torch.where(selection >= 0, selection, length), True)  # -1: a spare column
    return allowed[:, :length]


def one_token_blocks(cache: torch.Tensor) -> torch.Tensor:
    """A paged cache `(NB, BS, ...)` viewed as `(NB BS, 1, ...)` (the layout `selected_slots`
    indexes)."""
    return cache.view(-1, 1, *cache.shape[2:])


__all__ = ["BlockIndexer", "one_token_blocks", "select_step", "selected_slots", "selection_mask"]
