"""`relay.metadata_to`, which moves the metadata of a relayed forward between rank 0's device and
the CPU: every tensor moves, the nested ones too (`MambaMetadata.wave_copies`, the spare-slot
copies of speculative chains, is a tuple of `(src, dst)` tensor pairs)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_mamba.attention.backend import StepLayout
from vllm_mamba.attention.backends.paged import PagedAttentionBackend
from vllm_mamba.attention.backends.placeholder import PlaceholderAttentionBackend
from vllm_mamba.worker.relay import metadata_to

META = torch.device("meta")  # a device every machine has, unlike CUDA


def tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in `value`, however deeply nested."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in tensors(v)]
    if dataclasses.is_dataclass(value):
        return [t for f in dataclasses.fields(value) for t in tensors(getattr(value, f.name))]
    return []


def chains_layout() -> StepLayout:
    """Two chains of 3 and 2 positions and a plain decode (waves of 3, 2, 1 rows), and one
    prefill chunk; KV blocks of 4 tokens."""
    return StepLayout(
        decode_slots=[0, 1, 2, 0, 1, 0],
        prefill_lens=[3],
        prefill_slots=[3],
        prefill_context_lens=[0],
        decode_context_lens=[5, 6, 7, 6, 7, 7],
        block_size=4,
        decode_block_tables=[[0, 1], [2, 3], [4, 5], [0, 1], [2, 3], [0, 1]],
        prefill_block_tables=[[6]],
        decode_waves=[3, 2, 1],
        decode_chain_src=[0, 1, 2, 10, 13, 11],
        decode_chain_dst=[10, 13, 2, 11, 1, 0],
    )


def test_metadata_to_moves_nested_wave_copies() -> None:
    for backend in (PlaceholderAttentionBackend, PagedAttentionBackend):
        meta = backend.build_metadata(chains_layout(), torch.device("cpu"))
        assert len(meta.wave_copies) == 2 and all(len(pair) == 2 for pair in meta.wave_copies)
        moved = metadata_to(meta, META)
        assert type(moved) is type(meta)
        assert len(tensors(moved)) == len(tensors(meta)) > 0
        assert all(t.device == META for t in tensors(moved)), backend.__name__
        assert all(t.device.type == "cpu" for t in tensors(meta))  # the original is left as is
        assert moved.decode_waves == meta.decode_waves and moved.num_decodes == 6
