"""Paged attention over a block KV cache: the cache write, decode and varlen-prefill attention.

Pure-PyTorch references (`*_ref`) of the attention ops of hybrid models. The fast kernels
(C++ on the CPU, `csrc/paged_attention.cpp`; Triton on CUDA,
`vllm_mamba.ops.triton_attention`) share these signatures and are chosen in
`vllm_mamba.ops.dispatch`; layers call them through the ops table with keyword arguments.

Glossary:
    T: tokens in the flat batch; B: decode rows; P: prefill sequences; Hq: query heads;
    Hkv: key/value heads (GQA/MQA: query head `h` reads kv head `h // (Hq // Hkv)`);
    D: head dim; NB: blocks in the pool; BS: tokens per block.
    `k_cache`, `v_cache`: `(NB, BS, Hkv, D)`, one pair per attention layer (vLLM's layout).
    A token's slot is `block_id * BS + offset`; `PAD_SLOT_ID` (-1) marks padding.
    `block_tables`: `(rows, max_blocks)` int32; row `i`'s position `p` lives in block
    `block_tables[i, p // BS]` at offset `p % BS`. Entries past a row's used blocks may hold
    anything (0, -1) and are never read.
    `seq_lens`: `(rows,)` int32, the tokens in the cache for each row, the new ones included.
    Math is float32 whatever the input dtype; outputs take the query's dtype. No rotary here:
    the model rotates queries and keys before caching them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.families import OpFamily, OpSpec

Tensor = torch.Tensor

__all__ = [
    "reshape_and_cache_ref",
    "paged_decode_attention_ref",
    "paged_prefill_attention_ref",
]


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes each token's key and value into its cache slot, in place.

    Args:
        key, value: `(T, Hkv, D)` the new tokens' keys and (rotated) values.
        k_cache, v_cache: `(NB, BS, Hkv, D)`; written at the tokens' slots (cast to the
            cache dtype).
        slot_mapping: `(T,)` int slot per token; slots `< 0` (`PAD_SLOT_ID`) are skipped.
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    valid = slots > PAD_SLOT_ID  # (T,)
    slots = slots[valid]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[valid].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[valid].to(v_cache.dtype)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence, in float32: `(length, Hkv, D)`."""
    block_size = cache.shape[1]
    positions = torch.arange(length, device=cache.device)  # (L,)
    blocks = block_table[: (length + block_size - 1) // block_size].long()
    return cache[blocks[positions // block_size], positions % block_size].float()


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Masked softmax attention of one sequence's queries over its context, in float32.

    Args:
        query: `(Q, Hq, D)` float32.
        keys: `(L, Hkv, D)` float32; values: `(L, Hkv, Dv)` float32 (Dv is D but for MLA).
        allowed: `(Q, L)` bool, which positions each query may read.
        scale: the softmax scale.

    Returns:
        `(Q, Hq, Dv)` float32; queries with no allowed position get zeros.
    """
    num_q, num_heads, head_dim = query.shape
    num_kv = keys.shape[1]
    group = num_heads // num_kv
    q = query.view(num_q, num_kv, group, head_dim)  # (Q, Hkv, G, D)
    scores = torch.einsum("qkgd,lkd->kgql", q, keys) * scale  # (Hkv, G, Q, L)
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
    weights = torch.exp(scores - row_max)  # exp(-inf) = 0 at masked positions
    denom = weights.sum(dim=-1, keepdim=True)
    probs = weights / denom.clamp(min=torch.finfo(torch.float32).tiny)
    out = torch.einsum("kgql,lkd->qkgd", probs, values)  # (Q, Hkv, G, Dv)
    return out.reshape(num_q, num_heads, values.shape[-1])


def _check_heads(query: torch.Tensor, k_cache: torch.Tensor) -> None:
    assert k_cache.dim() == 4, "k_cache must be (num_blocks, block_size, num_kv_heads, head_dim)"
    assert query.shape[-1] == k_cache.shape[-1], "query and cache head dims differ"
    assert query.shape[-2] % k_cache.shape[2] == 0, "query heads must be a multiple of kv heads"


def paged_decode_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per row attending to positions `[0, seq_len)` of its sequence's cache.

    The row's own key and value were already written (`reshape_and_cache_ref`).

    Args:
        query: `(B, Hq, D)`.
        k_cache, v_cache: `(NB, BS, Hkv, D)`.
        block_tables: `(B, max_blocks)` int32.
        seq_lens: `(B,)` int32; 0 marks a padding row.
        scale: the softmax scale (usually `D ** -0.5`).

    Returns:
        `(B, Hq, D)` in the query's dtype; padding rows are zeros.
    """
    _check_heads(query, k_cache)
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)  # (B, Hq, D)
    for row, length in enumerate(seq_lens.tolist()):
        if length <= 0:
            continue
        keys = _gather_context(k_cache, block_tables[row], length)  # (L, Hkv, D)
        values = _gather_context(v_cache, block_tables[row], length)
        allowed = torch.ones(1, length, dtype=torch.bool, device=query.device)
        out[row] = _attend(query[row : row + 1].float(), keys, values, allowed, scale)[0]
    return out.to(query.dtype)


def paged_prefill_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed prefill chunks over their cached context and themselves.

    Sequence `p` owns queries `[qsl[p], qsl[p + 1])`; with `q_len` of them, query `j` sits at
    absolute position `seq_lens[p] - q_len + j` and reads cache positions up to its own. The
    chunk's keys and values, and those of the earlier chunks, are already in the cache, so a
    prefill split into chunks across block boundaries equals the whole prefill.

    Args:
        query: `(T, Hq, D)`, sequences packed back to back.
        k_cache, v_cache: `(NB, BS, Hkv, D)`.
        block_tables: `(P, max_blocks)` int32.
        query_start_loc: `(P + 1,)` int32, cumulative query starts.
        seq_lens: `(P,)` int32, context plus chunk length of each sequence.
        scale: the softmax scale.

    Returns:
        `(T, Hq, D)` in the query's dtype; tokens after `qsl[P]` (padding) are zeros.
    """
    _check_heads(query, k_cache)
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)  # (T, Hq, D)
    starts = query_start_loc.tolist()
    for seq, length in enumerate(seq_lens.tolist()):
        begin, end = starts[seq], starts[seq + 1]
        q_len = end - begin
        if q_len <= 0:
            continue
        assert length >= q_len, "seq_lens must count the chunk's own tokens"
        keys = _gather_context(k_cache, block_tables[seq], length)  # (L, Hkv, D)
        values = _gather_context(v_cache, block_tables[seq], length)
        q_pos = torch.arange(length - q_len, length, device=query.device)  # (Q,)
        k_pos = torch.arange(length, device=query.device)  # (L,)
        allowed = k_pos[None, :] <= q_pos[:, None]  # (Q, L)
        out[begin:end] = _attend(query[begin:end].float(), keys, values, allowed, scale)
    return out.to(query.dtype)


class ReshapeAndCacheOp(Protocol):
    def __call__(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    ) -> None: ...  # fmt: skip


class PagedDecodeOp(Protocol):
    def __call__(
        self, query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
        seq_lens: Tensor, scale: float,
    ) -> Tensor: ...  # fmt: skip


class PagedPrefillOp(Protocol):
    def __call__(
        self, query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
        query_start_loc: Tensor, seq_lens: Tensor, scale: float,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    "paged_attention",
    {
        "reshape_and_cache": OpSpec(ReshapeAndCacheOp, reshape_and_cache_ref),
        "decode": OpSpec(PagedDecodeOp, paged_decode_attention_ref),
        "prefill": OpSpec(PagedPrefillOp, paged_prefill_attention_ref),
    },
)
