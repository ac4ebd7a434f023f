"""KV groups of sliding-window layers (`kv_cache.plan_kv_groups`): which layers share a block
table and which cache tensors, what a block weighs, and how many blocks a sequence holds."""

from __future__ import annotations

import torch

from vllm_mamba.cache_specs import AttentionSpec, MLASpec
from vllm_mamba.kv_cache import KVCache, plan_kv_groups, plan_num_blocks

CPU = torch.device("cpu")
F32 = torch.float32


def _spec(window: int | None = None, heads: int = 2) -> AttentionSpec:
    return AttentionSpec(heads, 16, F32, window)


def test_full_attention_is_one_group_of_every_layer() -> None:
    groups = plan_kv_groups([_spec(), _spec(), _spec()])
    assert groups.windows == (None,) and groups.layer_tensor == (0, 1, 2)


def test_mixed_windows_form_equal_groups_sharing_tensors() -> None:
    """Two full and five sliding layers: groups of two layers (the smaller kind's count), the
    sliding kind in three groups (the last one short), the j-th layer of each on tensor j."""
    windows = [8, None, 8, 8, None, 8, 8]
    groups = plan_kv_groups([_spec(w) for w in windows])
    assert groups.windows == (8, 8, 8, None)
    assert groups.layer_group == (0, 3, 0, 1, 3, 1, 2)
    assert groups.layer_tensor == (0, 0, 1, 0, 1, 1, 0)
    assert len(groups.tensor_specs) == 2 and groups.tensor_specs[0].sliding_window is None


def test_one_window_for_all_layers_is_one_sliding_group() -> None:
    groups = plan_kv_groups([_spec(16), _spec(16)])
    assert groups.windows == (16,) and groups.layer_tensor == (0, 1)


def test_layers_of_different_shapes_keep_their_tensors_and_all_blocks() -> None:
    """A sliding layer whose spec differs from a full one's cannot share tensors: one group,
    full attention (nothing is dropped); MLA layers likewise."""
    groups = plan_kv_groups([_spec(8, heads=1), _spec(None, heads=2)])
    assert groups.windows == (None,) and groups.layer_tensor == (0, 1)
    groups = plan_kv_groups([MLASpec(40, F32), _spec(8)])
    assert groups.windows == (None,)


def test_block_weight_and_blocks_per_sequence() -> None:
    """A block of the pool holds one layer per group position; a sequence's blocks are its
    full groups' whole length plus a bounded number per sliding group."""
    specs = [_spec(8), _spec(None), _spec(8), _spec(8)]  # groups of 1: (8, 8, 8, None)
    sizing = plan_num_blocks(specs, 4, 2, 64, CPU, num_blocks_override=50)
    assert sizing.bytes_per_block == 4 * _spec().bytes_per_token()
    cache = KVCache(specs, sizing, CPU)
    assert len(cache.layer_tensors) == 1 and cache.nbytes() == sizing.nbytes
    views = [cache.layer(i) for i in range(4)]
    assert [v.group for v in views] == [0, 3, 1, 2]
    assert all(v.k is views[0].k for v in views)
    groups = cache.groups
    # 100 tokens, chunks of at most 16: 25 full blocks, and (8 - 1 + 16) // 4 + 2 = 7 per
    # sliding group (fewer when the sequence is short).
    assert groups.blocks_per_seq(100, 4, 16) == 25 + 3 * 7
    assert groups.blocks_per_seq(6, 4, 16) == 4 * 2
    assert groups.max_seq_tokens(25 + 3 * 7, 4, 16) == 100
    assert plan_kv_groups([_spec(8)]).max_seq_tokens(10, 4, 16) is None


def test_full_layers_form_one_group_without_padding() -> None:
    """LFM3-1.7B's plan (6 full, 5 sliding layers): groups of 6, the full layers one group with
    every tensor used, the sliding ones one group with a tensor to spare (its blocks are few)."""
    windows = [None if i % 4 == 2 else 256 for i in range(2, 24, 2)]  # 6 full, 5 sliding
    groups = plan_kv_groups([_spec(w) for w in windows])
    assert sorted(groups.windows, key=str) == [256, None]
    full = groups.windows.index(None)
    assert groups.layer_group.count(full) == 6 and len(groups.tensor_specs) == 6
