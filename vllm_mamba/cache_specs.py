"""What each layer keeps per sequence: the cache specs the engine allocates from.

A leaf module (torch dtypes only, no tensors): layers declare their specs, the state cache
(`state_cache`) and the paged KV cache (`kv_cache`) allocate from them, and the kernels read
`PAD_SLOT_ID`.

- `StateSpec`: a recurrent layer's per-sequence state, as named tensors (`StateTensor`) with
  shapes, dtypes and a kind. Mamba: `conv (I, K - 1)` and `ssm (I, N)`; Mamba2:
  `conv (CD, K - 1)` and `ssm (NH, P, N)`; a short conv would have one tensor, a delta rule a
  conv history and a `(heads, key_dim, value_dim)` matrix, RWKV-7 three tensors. A spec is
  declared with the dtype of each tensor left to the engine's rule (`resolve`): a `conv` history
  is kept in the model dtype, a `recurrent` state in float32 unless `ssm_state_dtype` says
  otherwise; a tensor declared with a dtype keeps it.
- `AttentionSpec`: an attention layer's KV blocks (a K and a V tensor per layer), with its
  sliding window if it has one.
- `MLASpec`: a Multi-head Latent Attention layer's blocks: one latent row per token (the
  normed compressed KV `c` and the shared rope key), one tensor per layer, no V tensor.
- `IndexerSpec`: the keys of a sparse-attention indexer (GLM-5-Next's DSA, Qwen4-Exp's QSA),
  the third cache kind: per token a row (its indexer key, and GLM's pooling gate), per complete
  pool of `kpool` tokens the pooled key. They live beside the KV of the same layer
  (`MLASpec.indexer`, `AttentionSpec.indexer`), in the same blocks, so admission, preemption,
  forks and prefix caching move them with the keys and values.
- `KVSpec`: either of the two, what the paged KV cache (`kv_cache`) allocates from.

Specs are read off the built model (under tensor parallelism, each rank's shard), layer by
layer in module order, by `collect_layer_specs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

__all__ = [
    "PAD_SLOT_ID",
    "StateKind",
    "StateTensor",
    "StateSpec",
    "AttentionSpec",
    "MLASpec",
    "IndexerSpec",
    "KVSpec",
    "LayerCacheSpec",
]

PAD_SLOT_ID = -1  # the slot index of a padding row; the kernels neither read nor write it

# "conv": a history of recent inputs, kept in the model dtype; "recurrent": a state the layer
# accumulates into (an SSM state, a delta-rule matrix), float32 unless `ssm_state_dtype`.
StateKind = Literal["conv", "recurrent"]


@dataclass(frozen=True)
class StateTensor:
    """One named per-sequence state tensor of a layer: `shape` per slot, its kind and dtype
    (None: decided by the engine's rule, see `StateSpec.resolve`)."""

    name: str
    shape: tuple[int, ...]
    kind: StateKind = "recurrent"
    dtype: torch.dtype | None = None

    def nbytes(self) -> int:
        """Bytes of this tensor for one sequence (its dtype must be resolved)."""
        assert self.dtype is not None, f"state {self.name!r} has no dtype yet"
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class StateSpec:
    """A recurrent layer's per-sequence state: its named tensors, in a fixed order.

    Layers with equal specs share one tensor per name in the state cache.
    """

    tensors: tuple[StateTensor, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a state spec needs distinct tensor names, got {names}")

    @property
    def names(self) -> tuple[str, ...]:
        """The tensors' names, in order."""
        return tuple(t.name for t in self.tensors)

    def resolve(self, model_dtype: torch.dtype, state_dtype: torch.dtype | None) -> StateSpec:
        """This spec with every dtype decided: `conv` tensors in `model_dtype`, `recurrent`
        ones in `state_dtype` (the `ssm_state_dtype` option; None: float32); a tensor that
        declared its dtype keeps it."""

        def dtype_of(t: StateTensor) -> torch.dtype:
            if t.dtype is not None:
                return t.dtype
            if t.kind == "conv":
                return model_dtype
            return state_dtype if state_dtype is not None else torch.float32

        return StateSpec(tuple(replace(t, dtype=dtype_of(t)) for t in self.tensors))

    def bytes_per_slot(self) -> int:
        """State bytes of one sequence in this layer (dtypes resolved)."""
        return sum(t.nbytes() for t in self.tensors)


@dataclass(frozen=True)
class IndexerSpec:
    """A sparse-attention indexer's cache: per token a row of `row_dim` values, per complete
    pool of `kpool` tokens its pooled key `(index_dim)`, in `dtype`. A pool never straddles a
    block (the block size is a multiple of `kpool`), so each block holds `block_size // kpool`
    pooled keys."""

    row_dim: int
    index_dim: int
    kpool: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        """Indexer bytes of one token (its row and its share of a pooled key)."""
        per_pool = self.row_dim * self.kpool + self.index_dim
        return per_pool * self.dtype.itemsize // self.kpool


@dataclass(frozen=True)
class AttentionSpec:
    """An attention layer: KV blocks of `num_kv_heads x head_dim` per token in `dtype`;
    `sliding_window` (tokens, None for full attention): a query at position p reads only
    `(p - W, p]`, so the blocks every window has passed can be freed."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int | None = None
    indexer: IndexerSpec | None = None  # the indexer keys beside K and V (QSA layers)

    def bytes_per_token(self) -> int:
        """K and V (and indexer) bytes of one token in this layer."""
        extra = self.indexer.bytes_per_token() if self.indexer is not None else 0
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize + extra


@dataclass(frozen=True)
class MLASpec:
    """A Multi-head Latent Attention layer: blocks of one `latent_dim` row per token in `dtype`.

    The row is `[c (kv_lora_rank) | k_rot (qk_rope_head_dim)]`, shared by every head: keys and
    values are expanded from it (or absorbed into the queries) by the layer, so the cache holds
    `latent_dim` values per token instead of `2 * heads * head_dim`.
    """

    latent_dim: int
    dtype: torch.dtype
    indexer: IndexerSpec | None = None  # the indexer keys beside the latents (DSA layers)

    def bytes_per_token(self) -> int:
        """Latent (and indexer) bytes of one token in this layer."""
        extra = self.indexer.bytes_per_token() if self.indexer is not None else 0
        return self.latent_dim * self.dtype.itemsize + extra


KVSpec = AttentionSpec | MLASpec  # a layer's blocks in the paged KV cache
LayerCacheSpec = StateSpec | AttentionSpec | MLASpec
