"""Multi-head Latent Attention (MLA) over a paged latent cache: the op family `mla`.

Pure-PyTorch references (`*_ref`) of the ops of `vllm_mamba.layers.mla_attention.MLAAttention`,
registered as the op family `mla` (`vllm_mamba.ops.families`); the C++ kernels
(`csrc/mla_attention.cpp`, backend `cpp`) and the Triton kernels
(`vllm_mamba.ops.triton_mla`, backend `triton`) register faster versions under the same
names and signatures:

    ops = layer_ops.family("mla")
    ops.cache_write(latent, cache, slot_mapping)                        # mla_cache_write_ref
    ops.decode_attention(query, cache, block_tables, seq_lens, scale, v_dim)
    ops.prefill_attention(query, cache, block_tables, query_start_loc, seq_lens, scale, v_dim)

The cache holds one latent row per token, `[c (R) | k_rot (Dr)]` (`L = R + Dr` values), shared
by all heads: DeepSeek-V2/V3 and Kimi Linear cache that instead of per-head keys and values.
The attention runs in the ABSORBED form: with `W_UK`, `W_UV` the per-head key and value halves
of `kv_b_proj`, the layer passes `query = [q_nope @ W_UK | q_rot] (Hq, L)`, so that

    score_t = scale * (query . latent_t) = scale * (q_nope . k_nope_t + q_rot . k_rot_t)
    out = sum_t softmax(score)_t c_t                  (the first `v_dim = R` values of a row)

and maps `out (Hq, R)` through `W_UV` to the values itself. That is multi-query attention with
one key/value head of dim L whose value is the first `v_dim` columns of the key. (The layer
runs decode this way; its prefill expands the latents by default and uses `prefill_attention`
for sequences too long to expand, see `vllm_mamba.layers.mla_attention`.)

Glossary:
    T: tokens in the flat batch; B: decode rows; P: prefill sequences; Hq: query heads;
    L: latent dim; R: kv_lora_rank (`v_dim`); NB: blocks in the pool; BS: tokens per block.
    `cache`: `(NB, BS, L)`, one per MLA layer; a token's slot is `block_id * BS + offset`;
    `PAD_SLOT_ID` (-1) marks padding. `block_tables`, `seq_lens`, `query_start_loc`: as in
    `vllm_mamba.ops.paged_attention` (seq_lens count the cached context and the new tokens).
    Math is float32 whatever the input dtypes (float32, bfloat16, float16 caches); outputs take
    the query's dtype.
"""

from __future__ import annotations

from typing import Protocol

import torch

from vllm_mamba.ops.families import OpFamily, OpSpec
from vllm_mamba.ops.paged_attention import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)

Tensor = torch.Tensor

__all__ = [
    "FAMILY",
    "mla_cache_write_ref",
    "mla_decode_attention_ref",
    "mla_prefill_attention_ref",
]

FAMILY = "mla"


def mla_cache_write_ref(
    latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes each token's latent row into its cache slot, in place.

    Args:
        latent: `(T, L)` the new tokens' `[c_normed | k_rot]` (k_rot rotated when the model
            has a rotary embedding).
        cache: `(NB, BS, L)`; written at the tokens' slots (cast to the cache dtype).
        slot_mapping: `(T,)` int slot per token; slots `< 0` (`PAD_SLOT_ID`) are skipped.
    """
    assert cache.dim() == 3 and latent.shape[-1] == cache.shape[-1], "cache must be (NB, BS, L)"
    block_size = cache.shape[1]
    slots = slot_mapping.long()
    valid = slots >= 0  # (T,)
    slots = slots[valid]
    cache[slots // block_size, slots % block_size] = latent[valid].to(cache.dtype)


def _check(query: torch.Tensor, cache: torch.Tensor, v_dim: int) -> None:
    assert cache.dim() == 3, "cache must be (num_blocks, block_size, latent_dim)"
    assert query.shape[-1] == cache.shape[-1], "query and latent dims differ"
    assert 0 < v_dim <= cache.shape[-1], "v_dim must be in (0, latent_dim]"


def mla_decode_attention_ref(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
) -> torch.Tensor:
    """One absorbed query per row over positions `[0, seq_len)` of its latent cache.

    Args:
        query: `(B, Hq, L)`, `[q_nope @ W_UK | q_rot]` per head.
        cache: `(NB, BS, L)`, the row's own latent already written.
        block_tables: `(B, max_blocks)` int32.
        seq_lens: `(B,)` int32; 0 marks a padding row.
        scale: the softmax scale (`(qk_nope + qk_rope) ** -0.5`).
        v_dim: the value columns of a latent row (`kv_lora_rank`).

    Returns:
        `(B, Hq, v_dim)` in the query's dtype; padding rows are zeros.
    """
    _check(query, cache, v_dim)
    kv = cache.unsqueeze(2)  # (NB, BS, 1, L): one key/value head
    out = paged_decode_attention_ref(query, kv, kv, block_tables, seq_lens, scale)
    return out[..., :v_dim].contiguous()


def mla_prefill_attention_ref(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
) -> torch.Tensor:
    """Causal absorbed attention of packed prefill chunks over their cached context.

    Sequence `p` owns queries `[qsl[p], qsl[p + 1])`; query `j` of its `q_len` sits at position
    `seq_lens[p] - q_len + j` and reads the latents up to its own, so chunked prefill equals
    whole prefill (as `paged_prefill_attention_ref`).

    Args:
        query: `(T, Hq, L)` absorbed queries, sequences packed back to back.
        cache: `(NB, BS, L)`, the chunks' latents already written.
        block_tables: `(P, max_blocks)` int32.
        query_start_loc: `(P + 1,)` int32.
        seq_lens: `(P,)` int32, context plus chunk of each sequence.
        scale: the softmax scale.
        v_dim: the value columns of a latent row.

    Returns:
        `(T, Hq, v_dim)` in the query's dtype; tokens after `qsl[P]` (padding) are zeros.
    """
    _check(query, cache, v_dim)
    kv = cache.unsqueeze(2)
    out = paged_prefill_attention_ref(query, kv, kv, block_tables, query_start_loc, seq_lens, scale)
    return out[..., :v_dim].contiguous()


class CacheWriteOp(Protocol):
    def __call__(self, latent: Tensor, cache: Tensor, slot_mapping: Tensor) -> None: ...


class DecodeOp(Protocol):
    def __call__(
        self, query: Tensor, cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float,
        v_dim: int,
    ) -> Tensor: ...  # fmt: skip


class PrefillOp(Protocol):
    def __call__(
        self, query: Tensor, cache: Tensor, block_tables: Tensor, query_start_loc: Tensor,
        seq_lens: Tensor, scale: float, v_dim: int,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    FAMILY,
    {
        "cache_write": OpSpec(CacheWriteOp, mla_cache_write_ref),
        "decode_attention": OpSpec(DecodeOp, mla_decode_attention_ref),
        "prefill_attention": OpSpec(PrefillOp, mla_prefill_attention_ref),
    },
)
