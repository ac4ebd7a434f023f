"""`PoolIndexer`: GLM-5-Next's sparse-attention indexer (DSA with k-pool compression), which
picks for every query the cached tokens its MLA layer attends to.

Per token, with transformers' names (`indexer.*` under the attention layer):

    key  = k_norm(wk(x))                         (D)   LayerNorm with bias, eps 1e-6
    gate = x @ index_kpool_compress_gate^T       (D)
    q    = wq_b(q_resid)                         (Hi, D)  q_resid = q_a_layernorm(q_a_proj(x))
    w    = weights_proj(x) * Hi^-1/2             (Hi,)

Tokens are grouped in pools of `kpool` from position 0. A complete pool `j` (tokens
`[j kpool, (j + 1) kpool)`) has one pooled key, a per-channel softmax over its tokens:

    pooled_j = sum_t softmax_t(gate_t + ape_t) * key_t          ape = index_kpool_compress_ape

A query at position `p` sees the `n = (p + 1) // kpool` pools complete by then and scores
them `s_j = sum_h w_h relu(scale * q_h . pooled_j)` (scale `D^-1/2`); it selects the best
`index_topk // kpool` (all when fewer), their tokens, and the incomplete pool it is in (the
"tail", `(p + 1) % kpool` tokens, with `index_kpool_always_select_tail`). A query whose own
pool has just completed sees it only if it is selected, as transformers computes it.

The cache (`cache_specs.IndexerSpec`, beside the layer's latents): each token's row
`[key | gate]` at its slot, and each complete pool's key, computed when its last token is
written (`write`), at index `slot // kpool` of the flat pooled tensor (a pool never straddles
a block). A speculative token written again rewrites its row and its pool's key.

The selection (`select`) is `(T, W)` token positions per query, `-1` padded, `W = index_topk +
kpool - 1`; a "shared" layer reuses the previous indexer layer's selection as is.

Glossary: T tokens, H hidden size, Hi indexer heads, D index_head_dim, P pools, W selection
width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.layers.linear import Linear
from vllm_mamba.ops.table import MambaOps

KEY_NORM_EPS = 1e-6  # transformers builds `k_norm` with this epsilon, not the config's


class PoolIndexer(nn.Module):
    """The indexer's weights, its cache writes and its top-k selection."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        num_heads: int,
        head_dim: int,
        kpool: int,
        topk: int,
        ops: MambaOps,
    ) -> None:
        """Args: `hidden_size` H; `q_lora_rank` the MLA's query rank; `num_heads` Hi; `head_dim`
        D; `kpool` the pool size; `topk` the token budget (`index_topk`, a multiple of
        `kpool`); `ops` the ops table. Replicated under tensor parallelism.

        Raises:
            ValueError: `topk` is not a positive multiple of `kpool`.
        """
        super().__init__()
        if kpool < 1 or topk < kpool or topk % kpool:
            raise ValueError(
                f"index_topk ({topk}) must be a positive multiple of index_kpool ({kpool})"
            )
        self.num_heads, self.head_dim, self.kpool, self.topk = num_heads, head_dim, kpool, topk
        self.wq_b = Linear(q_lora_rank, num_heads * head_dim, False, ops)
        self.wk = Linear(hidden_size, head_dim, False, ops)
        self.k_norm = nn.LayerNorm(head_dim, eps=KEY_NORM_EPS)
        self.weights_proj = Linear(hidden_size, num_heads, False, ops)
        self.index_kpool_compress_ape = nn.Parameter(torch.empty(kpool, head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(head_dim, hidden_size))

    @property
    def width(self) -> int:
        """W: the selection's width (the budget and a tail)."""
        return self.topk + self.kpool - 1

    def write(
        self, x: torch.Tensor, rows: torch.Tensor, pooled: torch.Tensor,
        slots: torch.Tensor, positions: torch.Tensor,
    ) -> None:  # fmt: skip
        """Writes the tokens' rows `[key | gate]` and the keys of the pools they complete.

        Args:
            x: `(T, H)` the layer's input.
            rows: `(NB, BS, 2 D)` the indexer rows of the pool.
            pooled: `(NB, BS // kpool, D)` the pooled keys.
            slots: `(T,)` each token's slot (`< 0`: padding, skipped).
            positions: `(T,)` each token's position in its sequence.
        """
        key = self.k_norm(self.wk(x))  # (T, D)
        gate = F.linear(x, self.index_kpool_compress_gate)  # (T, D)
        slots, valid = slots.long(), slots >= 0
        flat = rows.view(-1, rows.shape[-1])  # (NB BS, 2 D)
        flat[slots[valid]] = torch.cat([key, gate], dim=-1)[valid].to(rows.dtype)
        ends = valid & ((positions.long() + 1) % self.kpool == 0)  # tokens completing a pool
        if not bool(ends.any()):
            return
        last = slots[ends]  # (M,)
        members = last[:, None] - torch.arange(self.kpool - 1, -1, -1, device=last.device)
        group = flat[members]  # (M, kpool, 2 D)
        keys, gates = group.split(self.head_dim, dim=-1)
        logits = gates.float() + self.index_kpool_compress_ape.float()  # (M, kpool, D)
        weights = logits.softmax(dim=1).to(keys.dtype)
        pooled.view(-1, self.head_dim)[last // self.kpool] = (
            (weights * keys).sum(dim=1).to(pooled.dtype)
        )

    def select(
        self, x: torch.Tensor, q_resid: torch.Tensor, pooled: torch.Tensor,
        tables: torch.Tensor, positions: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The tokens each query attends to.

        Args:
            x: `(Q, H)` the queries' layer input.
            q_resid: `(Q, q_lora_rank)` their normed low-rank query.
            pooled: `(NB, BS // kpool, D)` the pooled keys.
            tables: `(Q, max_blocks)` each query's block table (rows of one sequence repeat).
            positions: `(Q,)` each query's position.

        Returns:
            `(Q, W)` int64 token positions, `-1` padded.
        """
        num_q, kpool = x.shape[0], self.kpool
        positions = positions.long()
        seen = (positions + 1) // kpool  # (Q,) complete pools visible
        num_pools = int(seen.max()) if num_q else 0
        picks = torch.full((num_q, 0), -1, dtype=torch.long, device=x.device)
        if num_pools:
            block_size = pooled.shape[1] * kpool
            starts = torch.arange(num_pools, device=x.device) * kpool  # (P,)
            blocks = tables.long()[:, starts // block_size]  # (Q, P)
            index = (blocks * block_size + starts % block_size) // kpool
            keys = pooled.view(-1, self.head_dim)[index].float()  # (Q, P, D)
            q = self.wq_b(q_resid).view(num_q, self.num_heads, self.head_dim).float()
            scores = F.relu(torch.matmul(q, keys.transpose(1, 2)) * self.head_dim**-0.5)
            w = self.weights_proj(x.to(self.weights_proj.compute_dtype)).float()
            w = w * self.num_heads**-0.5  # (Q, Hi)
            score = torch.matmul(w.unsqueeze(1), scores).squeeze(1)  # (Q, P)
            visible = torch.arange(num_pools, device=x.device) < seen[:, None]  # (Q, P)
            score = score.masked_fill(~visible, torch.finfo(score.dtype).min)
            chosen = score.topk(min(self.topk // kpool, num_pools), dim=-1).indices  # (Q, K)
            kept = visible.gather(1, chosen)
            offsets = torch.arange(kpool, device=x.device)
            picks = (chosen[..., None] * kpool + offsets).flatten(1)  # (Q, K kpool)
            picks = picks.masked_fill(~kept.repeat_interleave(kpool, dim=1), -1)
        tail_len = (positions + 1) % kpool  # (Q,)
        tail_offsets = torch.arange(kpool - 1, device=x.device)
        tail = seen[:, None] * kpool + tail_offsets  # (Q, kpool - 1)
        tail = tail.masked_fill(tail_offsets >= tail_len[:, None], -1)
        chosen_all = torch.cat([picks, tail], dim=-1)
        return F.pad(chosen_all, (0, self.width - chosen_all.shape[1]), value=-1)


__all__ = ["PoolIndexer"]
