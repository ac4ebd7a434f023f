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


def test_layers_of_unequal_heads_share_padded_tensors_when_that_saves() -> None:
    """Two sliding layers of 4 heads and two full layers of 2 (Inkling's shape): groups of 2
    on tensors of the wider token (one head of 64), since a padded full group keeps 128
    values a token against 192 for every layer."""
    groups = plan_kv_groups([_spec(8, heads=4), _spec(None), _spec(8, heads=4), _spec(None)])
    assert groups.windows == (8, None)
    assert groups.layer_group == (0, 1, 0, 1) and groups.layer_tensor == (0, 0, 1, 1)
    assert groups.tensor_specs == (AttentionSpec(1, 64, F32),) * 2


def test_layers_of_different_shapes_keep_their_tensors_and_all_blocks() -> None:
    """Where padding would cost more per token (two narrow full layers beside a wide sliding
    one: 2 x 128 against 16 + 16 + 128), or for MLA layers and mixed dtypes, every layer keeps
    a tensor of its own in one group, full attention (nothing is dropped)."""
    groups = plan_kv_groups([_spec(None, heads=1), _spec(8, heads=8), _spec(None, heads=1)])
    assert groups.windows == (None,) and groups.layer_tensor == (0, 1, 2)
    groups = plan_kv_groups([MLASpec(40, F32), _spec(8)])
    assert groups.windows == (None,)
    groups = plan_kv_groups([_spec(8), AttentionSpec(2, 16, torch.bfloat16)])
    assert groups.windows == (None,)


def test_padded_views_hold_each_layer_apart() -> None:
    """Each layer's view of a padded tensor is its `(NB, BS, Hkv, D)` at the start of every
    token's row: the cache write and decode attention (C++ when built, else the references)
    through the views equal the same on contiguous copies, and two layers sharing a tensor
    through different groups' blocks do not touch each other's tokens."""
    from vllm_mamba.ops.dispatch import get_mamba_ops

    ops = get_mamba_ops(CPU)
    specs = [_spec(8, heads=4), _spec(None, heads=1)]  # tensor 0 of both groups, 64 wide
    cache = KVCache(specs, plan_num_blocks(specs, 4, 2, 64, CPU, num_blocks_override=6), CPU)
    sliding, full = cache.layer(0), cache.layer(1)
    assert sliding.k.shape == (6, 4, 4, 16) and full.k.shape == (6, 4, 1, 16)
    assert full.k.data_ptr() == sliding.k.data_ptr() and full.k.stride() == (256, 64, 16, 1)
    torch.manual_seed(0)
    table = torch.tensor([[2, 5]], dtype=torch.int32)  # the full layer's sequence: blocks 2, 5
    for view, blocks in ((sliding, (1, 3)), (full, (2, 5))):
        heads = view.k.shape[2]
        slots = torch.tensor([b * 4 + i for b in blocks for i in range(4)])
        keys, values = torch.randn(8, heads, 16), torch.randn(8, heads, 16)
        ops.reshape_and_cache(keys, values, view.k, view.v, slots)
        assert torch.equal(view.k[list(blocks)].flatten(0, 1), keys)
    before = full.k[[2, 5]].clone()
    ones = torch.ones(4, 4, 16)
    ops.reshape_and_cache(ones, ones, sliding.k, sliding.v, torch.arange(4, 8))  # block 1
    assert torch.equal(full.k[[2, 5]], before)
    query = torch.randn(1, 2, 16)
    lens = torch.tensor([7], dtype=torch.int32)
    got = ops.paged_decode_attention(query, full.k, full.v, table, lens, 0.25)
    want = ops.paged_decode_attention(
        query, full.k.contiguous(), full.v.contiguous(), table, lens, 0.25
    )
    torch.testing.assert_close(got, want, atol=0, rtol=0)


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
