"""`PoolIndexer`: GLM-5-Next's sparse-attention indexer (DSA with k-pool compression), which
picks for every query the cached tokens its MLA layer attends to.

Per token, with transformers' names (`indexer.*` under the attention layer):

    key  = k_norm(wk(x))                         (D)   LayerNorm with bias, eps 1e-6
    gate = x @ index_kpool_compress_gate^T       (D)
    q    = wq_b(q_resid)                         (Hi, D)  q_resid = q_a_layernorm(q_a_proj(x))
    w    = weights_proj(x) * Hi^-1/2             (Hi,)

A complete pool `j` (tokens `[j kpool, (j + 1) kpool)`) has one pooled key, a per-channel
softmax over its tokens:

    pooled_j = sum_t softmax_t(gate_t + ape_t) * key_t          ape = index_kpool_compress_ape

and a query scores it `s_j = sum_h w_h relu(scale * q_h . pooled_j)` (scale `D^-1/2`). The
cached row of a token is `[key | gate]`; the pools, the cache writes and the selection of the
best `index_topk // kpool` pools plus the tail (`index_kpool_always_select_tail`) are
`layers.block_indexer`'s. A "shared" layer reuses the previous indexer layer's selection.

Glossary: T tokens, H hidden size, Hi indexer heads, D index_head_dim, P pools, W selection
width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.layers.block_indexer import BlockIndexer
from vllm_mamba.layers.linear import Linear
from vllm_mamba.ops.table import MambaOps

KEY_NORM_EPS = 1e-6  # transformers builds `k_norm` with this epsilon, not the config's


class PoolIndexer(BlockIndexer):
    """GLM-5-Next's indexer weights and math (see the module docstring)."""

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
        super().__init__(2 * head_dim, head_dim, kpool, topk)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.wq_b = Linear(q_lora_rank, num_heads * head_dim, False, ops)
        self.wk = Linear(hidden_size, head_dim, False, ops)
        self.k_norm = nn.LayerNorm(head_dim, eps=KEY_NORM_EPS)
        self.weights_proj = Linear(hidden_size, num_heads, False, ops)
        self.index_kpool_compress_ape = nn.Parameter(torch.empty(kpool, head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(head_dim, hidden_size))
        self.linear_op = ops.linear  # each row as alone (a chain's rows: the one-token steps')

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """`[key | gate]` per token -> `(T, 2 D)`."""
        key = self.k_norm(self.wk(x))  # (T, D)
        gate = self.linear_op(x, self.index_kpool_compress_gate, None)  # (T, D)
        return torch.cat([key, gate], dim=-1)

    def pool(self, group: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """The per-channel softmax of `gate + ape` over each pool's tokens -> `(M, D)`."""
        keys, gates = group.split(self.head_dim, dim=-1)  # (M, kpool, D) each
        logits = gates.float() + self.index_kpool_compress_ape.float()
        weights = logits.softmax(dim=1).to(keys.dtype)
        return (weights * keys).sum(dim=1)

    def score(
        self, x: torch.Tensor, query_input: torch.Tensor, positions: torch.Tensor,
        keys: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """`sum_h w_h relu(D^-1/2 q_h . k_j)`, `query_input` the normed low-rank query."""
        num_q = x.shape[0]
        q = self.wq_b(query_input).view(num_q, self.num_heads, self.head_dim).float()
        scores = F.relu(torch.matmul(q, keys.transpose(1, 2)) * self.head_dim**-0.5)  # (Q, Hi, P)
        w = self.weights_proj(x.to(self.weights_proj.compute_dtype)).float()
        w = w * self.num_heads**-0.5  # (Q, Hi)
        return torch.matmul(w.unsqueeze(1), scores).squeeze(1)  # (Q, P)


__all__ = ["PoolIndexer"]
