"""The paged KV cache with an MLA layer's latent spec (`MLASpec`) beside a plain attention
layer (`AttentionSpec`): sizing, allocation, the views bound to the layers, block copies."""

from __future__ import annotations

import torch

from vllm_mamba.cache_specs import AttentionSpec, MLASpec
from vllm_mamba.kv_cache import KVCache, plan_num_blocks
from vllm_mamba.layers.cache_layers import LatentKV, LayerKV

CPU = torch.device("cpu")


def test_mla_spec_bytes() -> None:
    """One latent row per token: L values, no V tensor, whatever the heads."""
    assert MLASpec(576, torch.bfloat16).bytes_per_token() == 576 * 2
    assert MLASpec(40, torch.float32).bytes_per_token() == 160
    assert AttentionSpec(2, 16, torch.float32).bytes_per_token() == 2 * 2 * 16 * 4  # unchanged


def test_sizing_counts_latent_bytes() -> None:
    specs = [AttentionSpec(2, 16, torch.float32), MLASpec(40, torch.bfloat16)]
    per_block = 8 * (2 * 2 * 16 * 4 + 40 * 2)
    sizing = plan_num_blocks(specs, 8, 4, 64, CPU, memory_bytes=10 * per_block)
    assert (sizing.bytes_per_block, sizing.num_blocks) == (per_block, 10)
    only_latent = plan_num_blocks([MLASpec(40, torch.bfloat16)], 8, 4, 64, CPU, 100 * 640)
    assert only_latent.num_blocks == 32  # the budget holds 100, 4 sequences of 64 use 32


def test_allocation_views_and_block_copies() -> None:
    specs = [MLASpec(40, torch.bfloat16), AttentionSpec(2, 16, torch.float32)]
    sizing = plan_num_blocks(specs, 8, 4, 64, CPU, num_blocks_override=6)
    cache = KVCache(specs, sizing, CPU)
    latent, kv = cache.layer(0), cache.layer(1)
    assert isinstance(latent, LatentKV) and isinstance(kv, LayerKV)
    assert latent.latent.shape == (6, 8, 40) and latent.latent.dtype == torch.bfloat16
    assert kv.k.shape == kv.v.shape == (6, 8, 2, 16)
    assert not latent.latent.any()  # zeroed
    assert cache.nbytes() == sizing.nbytes == 6 * 8 * (40 * 2 + 2 * 2 * 16 * 4)

    latent.latent.copy_(torch.randn(latent.latent.shape))
    kv.k.copy_(torch.randn(kv.k.shape))
    kv.v.copy_(torch.randn(kv.v.shape))
    before = [t.clone() for t in (latent.latent, kv.k, kv.v)]
    cache.copy_blocks([1, 4], [3, 0])
    for now, old in zip((latent.latent, kv.k, kv.v), before, strict=True):
        assert torch.equal(now[3], old[1]) and torch.equal(now[0], old[4])
        assert torch.equal(now[[1, 2, 4, 5]], old[[1, 2, 4, 5]])  # the rest untouched
