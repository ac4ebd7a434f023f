"""`RelativeBiasAttention`: paged attention whose scores carry a per-token relative-position
bias (and, optionally, a per-token sink logit), for the Inkling families.

Each query token brings `rel (Hq, E)`: one bias value per head and backward distance
`d = p - j` in `[0, E)` (E the layer's bias extent) from the query at position p to the key
at position j; the bias is zero at `d >= E`. The scores of head h are

    s[j] = scale * (q_h . k_j) + (rel[h, p - j] if p - j < E else 0)     for j in the window

with the window `(p - W, p]` of a sliding layer (transformers' `kv_idx > q_idx - W`) or all of
`[0, p]`. With `sinks (Hq,)` per query, each head's softmax takes one more logit, the sink,
whose value vector is zero (it only absorbs probability mass): `softmax([s, sink])[:-1]`.

Neither term is something the paged kernels of `vllm_mamba.ops.paged_attention` take (they
score `scale * q . k` alone), so this layer computes the attention itself in PyTorch over the
same paged layout: it writes the step's keys and values with the table's `reshape_and_cache`,
then gathers the keys its queries read from the block tables (the decode rows all at once,
padded to the longest window; each prefill chunk on its own) (only blocks inside the window:
the engine frees those a window has passed) and runs a float32 masked softmax, as the `_ref`
functions there do. A kernel would need, besides the usual inputs, the per-token bias table
`rel (T, Hq, E)` read at index `p - j` (an additive `score_mod` of the query's row and the
distance) and the sink logits `(T, Hq)` added to each row's softmax denominator as `exp(sink -
max)`.

Beside it: `RelativeLogits`, Inkling's bank of bias profiles that turns each token's relative
states into its `rel`, and `log_scale`, the factor the full layers scale their queries and
biases by past a position.

Glossary: T tokens in the step, Hq query heads, Hkv key/value heads (query head h reads kv
head `h // (Hq / Hkv)`), D head dim, E bias extent, W window, L keys a chunk reads.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from vllm_mamba.attention.backends.paged import KVGroupView, PagedMetadata
from vllm_mamba.layers.attention import PagedAttention
from vllm_mamba.layers.cache_layers import LayerKV
from vllm_mamba.ops.paged_attention import window_start


def log_scale(positions: torch.Tensor, n_floor: int, alpha: float) -> torch.Tensor:
    """`tau (T,)` float32 at positions `p`: `1 + alpha * log(max((p + 1) / n_floor, 1))`, the
    factor the full-attention layers of the Inkling families scale their queries and biases by
    past `n_floor`."""
    return 1.0 + alpha * torch.log(((positions + 1).float() / n_floor).clamp(min=1.0))


class RelativeLogits(nn.Module):
    """`proj (d_rel, E)`: a bank of bias-by-distance profiles that each token's relative
    states mix into its per-head bias table (transformers' `rel_logits_proj`)."""

    def __init__(self, d_rel: int, extent: int) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.empty(d_rel, extent))

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """`states (T, Hq, d_rel)` -> `rel (T, Hq, E)`."""
        return states @ self.proj


class RelativeBiasAttention(PagedAttention):
    """Attention of one layer over the paged KV cache with a relative-position bias (see the
    module docstring); no parameters (the projections and the bias table belong to the
    model). Built as `PagedAttention` is (heads, head dim, scale, ops, window); its forward
    also takes the bias table and the sinks."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rel: torch.Tensor,
        meta: PagedMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Caches the step's keys and values, then attends.

        Args:
            q: `(T, Hq, D)`; k, v: `(T, Hkv, D)`.
            rel: `(T, Hq, E)` each query's bias by backward distance.
            sinks: `(T, Hq)` each query's sink logit per head, or None.

        Returns:
            `(T, Hq * D)` in q's dtype.
        """
        assert isinstance(self.kv, LayerKV), "the KV cache is not bound to this layer"
        view = meta.kv_view(self.kv.group)
        self.ops.reshape_and_cache(
            key=k, value=v, k_cache=self.kv.k, v_cache=self.kv.v, slot_mapping=view.slot_mapping
        )
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (T, Hq, D)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._attend_decodes(
                q[:nd], rel[:nd], None if sinks is None else sinks[:nd], meta, view
            )
        for rows, table, length in _prefills(meta, view):
            start = window_start(length - (rows.stop - rows.start), self.sliding_window)
            keys = _gather(self.kv.k, table, start, length)  # (L, Hkv, D)
            values = _gather(self.kv.v, table, start, length)
            out[rows] = self._attend(
                q[rows], keys, values, rel[rows], start, length,
                None if sinks is None else sinks[rows],
            )  # fmt: skip
        return out.to(q.dtype).flatten(1)

    def _attend_decodes(
        self,
        q: torch.Tensor,
        rel: torch.Tensor,
        sinks: torch.Tensor | None,
        meta: PagedMetadata,
        view: KVGroupView,
    ) -> torch.Tensor:
        """Every decode row at once (`_attend`'s math, the rows' windows padded to the longest):
        `q (B, Hq, D)`, `rel (B, Hq, E)` -> `(B, Hq, D)` float32 (zeros for padding rows)."""
        assert isinstance(self.kv, LayerKV)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lengths = meta.decode_seq_lens.long()  # (B,)
        live = (lengths > 0).nonzero().flatten()
        if not live.numel():
            return out
        lengths = lengths[live]
        window = self.sliding_window
        starts = (lengths - window).clamp(min=0) if window else torch.zeros_like(lengths)
        span = int((lengths - starts).max())
        pos = starts[:, None] + torch.arange(span, device=q.device)  # (B, L)
        valid = pos < lengths[:, None]
        pos = torch.where(valid, pos, starts[:, None])  # padding reads the window's first key
        block_size = self.kv.k.shape[1]
        blocks = view.decode_block_tables[live].long().gather(1, pos // block_size)  # (B, L)
        keys = self.kv.k[blocks, pos % block_size].float()  # (B, L, Hkv, D)
        values = self.kv.v[blocks, pos % block_size].float()
        dist = (lengths - 1)[:, None] - pos  # (B, L) backward distance from the query
        extent, group = rel.shape[-1], self.num_heads // self.num_kv_heads
        index = dist.clamp(0, extent - 1)[:, None, :].expand(-1, self.num_heads, -1)
        bias = rel[live].float().gather(-1, index)  # (B, Hq, L)
        bias = bias.masked_fill((dist >= extent)[:, None, :], 0.0)
        rows = live.numel()
        qg = q[live].float().view(rows, self.num_kv_heads, group, -1)  # (B, Hkv, G, D)
        scores = torch.einsum("bkgd,blkd->bkgl", qg, keys) * self.scale  # (B, Hkv, G, L)
        scores = scores + bias.view(rows, self.num_kv_heads, group, -1)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        if sinks is not None:  # one more logit per query and head, of value zero
            sink = sinks[live].float().view(rows, self.num_kv_heads, group, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        mixed = torch.einsum("bkgl,blkd->bkgd", probs, values)  # (B, Hkv, G, D)
        out[live] = mixed.reshape(rows, self.num_heads, -1)
        return out

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        rel: torch.Tensor,
        start: int,
        length: int,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """One sequence's last `Q` queries (at positions `length - Q ...`) over its keys at
        positions `[start, length)`: `(Q, Hq, D)` float32."""
        num_q, extent = q.shape[0], rel.shape[-1]
        group = self.num_heads // self.num_kv_heads
        q_pos = torch.arange(length - num_q, length, device=q.device)  # (Q,)
        k_pos = torch.arange(start, length, device=q.device)  # (L,)
        dist = q_pos[:, None] - k_pos[None, :]  # (Q, L)
        allowed = dist >= 0
        if self.sliding_window:
            allowed &= dist < self.sliding_window
        index = dist.clamp(0, extent - 1)[:, None, :].expand(-1, self.num_heads, -1)
        bias = rel.float().gather(-1, index).masked_fill((dist >= extent)[:, None, :], 0.0)
        qg = q.float().view(num_q, self.num_kv_heads, group, -1)  # (Q, Hkv, G, D)
        scores = torch.einsum("qkgd,lkd->kgql", qg, keys) * self.scale  # (Hkv, G, Q, L)
        bias = bias.view(num_q, self.num_kv_heads, group, -1).permute(1, 2, 0, 3)
        scores = (scores + bias).masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # one more logit per query and head, of value zero
            sink = sinks.float().view(num_q, self.num_kv_heads, group).permute(1, 2, 0)
            probs = torch.cat([scores, sink[..., None]], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out = torch.einsum("kgql,lkd->qkgd", probs, values)  # (Q, Hkv, G, D)
        return out.reshape(num_q, self.num_heads, -1)


def _prefills(meta: PagedMetadata, view: KVGroupView) -> Iterator[tuple[slice, torch.Tensor, int]]:
    """Each prefill chunk of the step: its rows, its block table and its length in the cache
    after this step (empty chunks left out)."""
    nd = meta.num_decodes
    starts = meta.prefill_query_start_loc.tolist()
    for seq, length in enumerate(meta.prefill_seq_lens.tolist()):
        if starts[seq + 1] > starts[seq]:
            rows = slice(nd + starts[seq], nd + starts[seq + 1])
            yield rows, view.prefill_block_tables[seq], length


def _gather(cache: torch.Tensor, table: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Positions `[start, length)` of one sequence from `cache (NB, BS, Hkv, D)` and its block
    `table`, in float32: `(L, Hkv, D)` (blocks before `start`'s are never read)."""
    block_size = cache.shape[1]
    positions = torch.arange(start, length, device=cache.device)  # (L,)
    blocks = table.long()[positions // block_size]
    return cache[blocks, positions % block_size].float()
