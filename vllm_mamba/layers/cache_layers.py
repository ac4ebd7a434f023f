"""The two kinds of layer that hold per-sequence cache, as the engine sees them.

- `StatefulLayer`: a recurrent mixer (Mamba, Mamba2, a plugin's own layer, ...). It declares
  its per-sequence state (`state_spec`, this rank's shard) and is given its view of the state
  cache (`bind_state`) before the first step: `self.state[name]` is `(S, *shape)` over all
  slots, read and advanced in place by its forward. It may offer fused decode steps, which a
  layer's decode plan takes once after binding (`fused_mixer_step`, `fused_layer_step`:
  `layers.decode_plan`).
- `KVCacheLayer`: an attention layer. It declares its KV blocks (`kv_spec`) and is given its
  view of the pool (`bind_kv_cache`): K and V tensors (`LayerKV`) for an `AttentionSpec`, one
  latent tensor (`LatentKV`) for an `MLASpec` (Multi-head Latent Attention).

The engine finds them by type, in module order (`stateful_layers`, `kv_cache_layers`), never
by probing for attributes; a model's forward never passes caches around.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from vllm_mamba.cache_specs import AttentionSpec, KVSpec, StateSpec

if TYPE_CHECKING:
    from vllm_mamba.layers.chain_log import ChainLog
    from vllm_mamba.layers.decode_plan import FusedStep

LayerState = dict[str, torch.Tensor]  # state name -> (S, *shape) over all slots


@dataclass
class LayerKV:
    """One attention layer's view of the pool: `k`, `v (num_blocks, block_size, Hkv, D)`, and
    the KV group whose block tables and slots it reads (`kv_cache.KVGroups`; 0 when the
    model's attention layers form one group); with an indexer (`IndexerSpec`) its rows
    `index_rows (num_blocks, block_size, row_dim)` and pooled keys `pooled (num_blocks,
    block_size // kpool, D)`."""

    k: torch.Tensor
    v: torch.Tensor
    group: int = 0
    index_rows: torch.Tensor | None = None
    pooled: torch.Tensor | None = None


@dataclass
class LatentKV:
    """One MLA layer's view of the pool: `latent (num_blocks, block_size, latent_dim)`; with an
    indexer (`IndexerSpec`) its rows `index_rows (num_blocks, block_size, row_dim)` and pooled keys
    `pooled (num_blocks, block_size // kpool, D)`."""

    latent: torch.Tensor
    index_rows: torch.Tensor | None = None
    pooled: torch.Tensor | None = None


LayerKVView = LayerKV | LatentKV  # what `KVCache.layer` hands a layer, by its spec's kind


class StatefulLayer(nn.Module):
    """Base of every layer with per-sequence recurrent state."""

    def __init__(self) -> None:
        super().__init__()
        self.state: LayerState = {}
        # Set by a fused decode plan whose kernel logs speculative chains (`layers.chain_log`).
        self.chain_log: ChainLog | None = None

    def state_spec(self) -> StateSpec:
        """This layer's per-sequence state (its shard's shapes under tensor parallelism)."""
        raise NotImplementedError

    def process_weights_after_loading(self) -> None:
        """Precomputes derived tensors after the weights are loaded (nothing by default)."""

    def bind_state(self, state: LayerState) -> None:
        """Takes this layer's views of the state cache, one per name of its spec."""
        assert set(state) == set(self.state_spec().names), (set(state), self.state_spec())
        self.state = state

    def fused_mixer_step(
        self, norm: nn.Module | None, residual_in_fp32: bool, residual_scale: float = 1.0
    ) -> FusedStep | None:
        """This mixer's decode-only steps as one fused call, made once at plan time from its
        weights and bound state: with the block's `norm` and residual (`residual_in_fp32`: kept
        in float32; `residual_scale`: the layer's residual multiplier, `h + rm * mixer(x)`)
        when given, else the mixer alone. None (the default): not offered."""
        return None

    def fused_layer_step(self, layer: nn.Module) -> FusedStep | None:
        """The decode-only steps of the whole decoder `layer` this mixer is the one mixer of,
        as one fused call made once at plan time. None (the default): not offered."""
        return None


class KVCacheLayer(nn.Module):
    """Base of every attention layer over the paged KV cache."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int = 0  # tokens a query reads back (itself included); 0: all

    def __init__(self) -> None:
        super().__init__()
        self.kv: LayerKVView | None = None

    def kv_spec(self, dtype: torch.dtype) -> KVSpec:
        """This layer's KV blocks (its shard's KV heads) in `dtype`, with its sliding window."""
        return AttentionSpec(self.num_kv_heads, self.head_dim, dtype, self.sliding_window or None)

    def process_weights_after_loading(self) -> None:
        """Precomputes derived tensors after the weights are loaded (nothing by default)."""

    def bind_kv_cache(self, kv: LayerKVView) -> None:
        """Takes this layer's view of the pool: K and V tensors `(num_blocks, block_size, Hkv,
        D)`, or the latent tensor `(num_blocks, block_size, latent_dim)` of an `MLASpec`."""
        self.kv = kv


def stateful_layers(model: nn.Module) -> list[StatefulLayer]:
    """The model's recurrent layers, in module order (a shared module once)."""
    return [m for m in model.modules() if isinstance(m, StatefulLayer)]


def kv_cache_layers(model: nn.Module) -> list[KVCacheLayer]:
    """The model's attention layers, in module order (a shared module once)."""
    return [m for m in model.modules() if isinstance(m, KVCacheLayer)]
