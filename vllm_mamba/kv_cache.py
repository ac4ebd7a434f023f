"""The paged KV cache of hybrid models: per-layer cache specs, the K/V tensors and their sizing.

Each attention layer of a model declares its KV blocks (`AttentionSpec` or `MLASpec`, from its
`KVCacheLayer.kv_spec`); recurrent layers hold a slot of `state_cache` instead. The attention layers
share one pool of `num_blocks` blocks of `block_size` tokens: block `b` holds tokens
`[b * block_size, (b + 1) * block_size)` of whichever sequence's block table lists it. Each
attention layer has its own tensors over the pool: K and V `(num_blocks, block_size,
num_kv_heads, head_dim)` for an `AttentionSpec` (the layout of `vllm_mamba.ops.paged_attention`),
one latent tensor `(num_blocks, block_size, latent_dim)` for an `MLASpec` (the layout of
`vllm_mamba.ops.mla_attention`), and with its `IndexerSpec` the indexer's rows `(num_blocks,
block_size, row_dim)` and pooled keys `(num_blocks, block_size // kpool, D)` (so the block size
must be a multiple of `kpool`). The slot of a token is `block_id * block_size + offset` in
either; a block copy (fork, prefix caching) copies every tensor of every layer.

Sliding-window layers (`AttentionSpec.sliding_window`) need only the blocks their window still
covers, so the layers are split into KV groups (`plan_kv_groups`, vLLM's hybrid allocator):
each group holds layers of one window (or full attention), all groups have the same number of
layers (the full-attention layers' count, so they form one group with no unused tensor; without
them the smallest kind's count; a kind with more layers is split into several groups, the last
one possibly short), and the `j`-th layer of every group shares the `j`-th cache tensors. A
block of the pool is then one block of one group; each sequence has a block table per group
(interleaved in one list: logical block `i` of group `g` at index `i * G + g`,
`engine.block_manager`), and a sliding group drops the blocks its window has passed.
Attention layers of one dtype whose heads differ (Inkling's sliding and full layers) share
tensors padded to the widest token of the layers sharing them, each layer viewing its
`num_kv_heads x head_dim` at the start of each token's row (vLLM pads its page sizes alike),
when that costs less per token than keeping every layer's blocks: the padded full-attention
group against all layers unbounded (`_padding_pays`). Otherwise, and for MLA layers or mixed
dtypes, every layer keeps a tensor of its own and they form one group, sliding only when all
of them are.

The pool is sized by an exact block count (`num_gpu_blocks_override`, vLLM's name), else by a
byte budget (`kv_cache_memory_bytes`), else by the default budget (`default_kv_cache_bytes`):
on the CPU a quarter of the memory available at startup, at most 4 GiB (vLLM's CPU default
space); on CUDA half of the free device memory. It never holds more blocks than
`max_num_seqs` sequences of `max_model_len` tokens can use. Attention-free models have no
pool at all.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch
from torch import nn

from vllm_mamba.cache_specs import AttentionSpec, KVSpec, MLASpec
from vllm_mamba.layers.cache_layers import LatentKV, LayerKV, LayerKVView, kv_cache_layers
from vllm_mamba.worker.huge_pages import huge_page_zeros

__all__ = [
    "KVCache",
    "KVCacheSizing",
    "KVGroups",
    "plan_kv_groups",
    "default_kv_cache_bytes",
    "plan_num_blocks",
]

CPU_KV_SHARE = 0.25  # of the memory available at startup
CPU_KV_CAP_BYTES = 4 * 2**30  # vLLM's default CPU KV cache space
CUDA_KV_SHARE = 0.5  # of the free device memory


@dataclass(frozen=True)
class KVCacheSizing:
    """How the pool was sized: its block count and size, and what decided them."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    source: str  # "num_gpu_blocks_override", "kv_cache_memory_bytes" or "default"

    @property
    def num_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of all cache tensors (K and V, or latents)."""
        return self.num_blocks * self.bytes_per_block


@dataclass(frozen=True)
class KVGroups:
    """How the attention layers share the pool (see the module docstring).

    Attributes:
        windows: per group, its layers' sliding window in tokens (None: full attention).
        layer_group: per attention layer (module order), its group.
        layer_tensor: per attention layer, the index of the cache tensors it uses.
        tensor_specs: per cache tensor set, its spec (without a window).
    """

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_tensor: tuple[int, ...]
    tensor_specs: tuple[KVSpec, ...]

    @property
    def num_groups(self) -> int:
        """Block tables per sequence."""
        return len(self.windows)

    def blocks_per_seq(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """Blocks one sequence of `num_tokens` holds at most, over all groups: every block of
        a full group, and of a sliding group those a window plus one chunk of at most
        `max_chunk` tokens spans."""
        full = -(-num_tokens // block_size)
        return sum(
            full if w is None else min(full, (w - 1 + max_chunk) // block_size + 2)
            for w in self.windows
        )

    def max_seq_tokens(self, num_blocks: int, block_size: int, max_chunk: int) -> int | None:
        """The longest sequence whose blocks (`blocks_per_seq`) fit `num_blocks`; None when
        every group slides (the length is not bounded by the pool)."""
        full = sum(w is None for w in self.windows)
        if full == 0:
            return None
        sliding = sum((w - 1 + max_chunk) // block_size + 2 for w in self.windows if w is not None)
        return max((num_blocks - sliding) // full, 0) * block_size


def _token_width(spec: KVSpec) -> int:
    """Elements of one token's keys (or values) in an attention layer's cache."""
    assert isinstance(spec, AttentionSpec), spec
    return spec.num_kv_heads * spec.head_dim


def _padding_pays(specs: list[KVSpec], windows: list[int | None], size: int) -> bool:
    """Whether layers of unequal heads should share padded tensors in groups of `size`: per
    token of a long sequence the padded plan keeps one full group of `size` tensors of the
    widest token (none without full layers), one group of every layer keeps them all."""
    if not all(isinstance(s, AttentionSpec) for s in specs) or len({s.dtype for s in specs}) > 1:
        return False
    if None not in windows:
        return True  # every group slides: bounded memory per sequence
    widest = max(_token_width(s) for s in specs)
    return size * widest < sum(_token_width(s) for s in specs)


def _padded(members: list[KVSpec]) -> KVSpec:
    """The spec of a tensor set the `members` share: theirs when they agree, else tokens as
    wide as the widest (one head of that width)."""
    if len(set(members)) == 1:
        return members[0]
    widest = max(_token_width(s) for s in members)
    return AttentionSpec(1, widest, members[0].dtype)


def plan_kv_groups(specs: list[KVSpec]) -> KVGroups:
    """Splits the attention layers into KV groups (see the module docstring)."""
    windows = [s.sliding_window if isinstance(s, AttentionSpec) else None for s in specs]
    bare = [replace(s, sliding_window=None) if isinstance(s, AttentionSpec) else s for s in specs]
    kinds = list(dict.fromkeys(windows))  # in order of first appearance
    # Full layers hold every block: they form exactly one group (no unused tensor in it);
    # a sliding group short of layers wastes only a window's blocks.
    size = windows.count(None) or min(windows.count(k) for k in kinds) if len(kinds) > 1 else 0
    if size and (len(set(bare)) == 1 or _padding_pays(bare, windows, size)):
        layer_group, layer_tensor = [0] * len(specs), [0] * len(specs)
        group_windows: list[int | None] = []
        for kind in kinds:
            members = [i for i, w in enumerate(windows) if w == kind]
            for start in range(0, len(members), size):
                for j, layer in enumerate(members[start : start + size]):
                    layer_group[layer], layer_tensor[layer] = len(group_windows), j
                group_windows.append(kind)
        tensor_specs = tuple(
            _padded([bare[i] for i in range(len(specs)) if layer_tensor[i] == j])
            for j in range(size)
        )
        return KVGroups(tuple(group_windows), tuple(layer_group), tuple(layer_tensor), tensor_specs)
    window = None if None in windows else max(windows, default=None)
    return KVGroups((window,), (0,) * len(specs), tuple(range(len(specs))), tuple(bare))


def default_kv_cache_bytes(device: torch.device) -> int:
    """The default byte budget of the pool on `device` (see the module docstring)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_KV_SHARE)
    return min(int(_available_memory() * CPU_KV_SHARE), CPU_KV_CAP_BYTES)


def _available_memory() -> int:
    """Bytes of memory available to new allocations (`MemAvailable`, else physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_num_blocks(
    specs: list[KVSpec],
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    device: torch.device,
    memory_bytes: int | None = None,
    num_blocks_override: int | None = None,
) -> KVCacheSizing:
    """Decides the pool's block count.

    Args:
        specs: the attention layers' specs (at least one); the pool holds the tensors of their
            KV groups (`plan_kv_groups`).
        block_size: tokens per block.
        max_num_seqs: sequences in flight at once.
        max_model_len: the longest sequence.
        device: where the pool lives.
        memory_bytes: the byte budget (`kv_cache_memory_bytes`), or None for the default.
        num_blocks_override: an exact block count, which wins over any budget.

    Returns:
        The sizing.

    Raises:
        ValueError: the budget does not hold a single block.
    """
    groups = plan_kv_groups(specs)
    per_block = block_size * sum(s.bytes_per_token() for s in groups.tensor_specs)
    if num_blocks_override is not None:
        return KVCacheSizing(num_blocks_override, block_size, per_block, "num_gpu_blocks_override")
    source = "kv_cache_memory_bytes" if memory_bytes is not None else "default"
    budget = memory_bytes if memory_bytes is not None else default_kv_cache_bytes(device)
    usable = max_num_seqs * math.ceil(max_model_len / block_size) * groups.num_groups
    num_blocks = min(budget // per_block, usable)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_bytes {budget} does not hold one KV block of {per_block} bytes "
            f"(block_size {block_size}); give more memory or a smaller block_size"
        )
    return KVCacheSizing(num_blocks, block_size, per_block, source)


class KVCache:
    """The cache tensors of every attention layer of one model, in one block pool."""

    def __init__(self, specs: list[KVSpec], sizing: KVCacheSizing, device: torch.device):
        self.specs = specs
        self.groups = plan_kv_groups(specs)
        self.sizing = sizing
        self.block_size = sizing.block_size
        self.num_blocks = sizing.num_blocks
        for spec in specs:
            indexer = spec.indexer
            if indexer is not None and sizing.block_size % indexer.kpool:
                raise ValueError(
                    f"block_size {sizing.block_size} must be a multiple of the sparse-attention "
                    f"indexer's pool of {indexer.kpool} tokens (index_kpool)"
                )
        # Per tensor set (a layer, or the j-th layer of every KV group): (K, V) for an
        # AttentionSpec, (latent,) for an MLASpec. Zeroed so that no kernel ever reads
        # uninitialised memory (NaN) in a masked lane; on the CPU the zero pages are mapped
        # as blocks are first written (`huge_page_zeros`).
        self.layer_tensors = [self._allocate(s, device) for s in self.groups.tensor_specs]

    def _allocate(self, spec: KVSpec, device: torch.device) -> tuple[torch.Tensor, ...]:
        shape = (self.sizing.num_blocks, self.sizing.block_size)
        if isinstance(spec, MLASpec):
            tensors = (huge_page_zeros((*shape, spec.latent_dim), spec.dtype, device),)
        else:
            assert isinstance(spec, AttentionSpec), spec
            k = huge_page_zeros((*shape, spec.num_kv_heads, spec.head_dim), spec.dtype, device)
            tensors = (k, huge_page_zeros(k.shape, k.dtype, device))
        index = spec.indexer
        if index is None:
            return tensors
        rows = huge_page_zeros((*shape, index.row_dim), index.dtype, device)
        pools = (shape[0], shape[1] // index.kpool, index.index_dim)
        return (*tensors, rows, huge_page_zeros(pools, index.dtype, device))

    def _all_tensors(self) -> list[torch.Tensor]:
        return [t for tensors in self.layer_tensors for t in tensors]

    def layer(self, index: int) -> LayerKVView:
        """Views of attention layer `index` (counted among the attention layers only); in a
        padded tensor, the layer's heads at the start of each token's row."""
        tensors = self.layer_tensors[self.groups.layer_tensor[index]]
        spec = self.specs[index]
        indexer = tuple(tensors[-2:]) if spec.indexer is not None else (None, None)
        if isinstance(spec, MLASpec):
            return LatentKV(tensors[0], *indexer)
        assert isinstance(spec, AttentionSpec), spec
        heads = (spec.num_kv_heads, spec.head_dim)
        k, v = (
            t
            if t.shape[2:] == heads
            else t.flatten(2)[:, :, : _token_width(spec)].unflatten(2, heads)
            for t in tensors[:2]
        )  # (NB, BS, Hkv, D), tokens `widest` apart in a padded tensor
        return LayerKV(k, v, self.groups.layer_group[index], *indexer)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copies blocks `src[i]` into `dst[i]` in every layer (copy-on-write of a fork)."""
        if not src:
            return
        device = self.layer_tensors[0][0].device
        src_t = torch.tensor(src, dtype=torch.long, device=device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=device)
        for cache in self._all_tensors():
            cache[dst_t] = cache[src_t]

    def nbytes(self) -> int:
        """Bytes of all cache tensors (K and V, or latents)."""
        return sum(t.numel() * t.element_size() for t in self._all_tensors())

    def bind(self, model: nn.Module) -> None:
        """Gives each attention layer (`KVCacheLayer`) of `model` its view, in module order."""
        layers = kv_cache_layers(model)
        assert len(layers) == len(self.specs), (len(layers), len(self.specs))
        for i, module in enumerate(layers):
            module.bind_kv_cache(self.layer(i))
