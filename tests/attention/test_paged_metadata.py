"""The paged backend's step metadata: token positions (which the rotary embedding reads) and
the KV slot of every token, for decodes and prefill chunks that continue from a context."""

from __future__ import annotations

import torch

from vllm_mamba.attention.backend import StepLayout
from vllm_mamba.attention.backends.paged import build_paged_metadata


def test_paged_metadata_carries_token_positions() -> None:
    """Decodes sit at their context length; a prefill chunk continues from its context."""
    layout = StepLayout(
        decode_slots=[0, 1],
        prefill_lens=[3, 2],
        prefill_slots=[2, 3],
        prefill_context_lens=[0, 17],
        decode_context_lens=[5, 16],
        block_size=16,
        decode_block_tables=[[4], [1, 2]],
        prefill_block_tables=[[3], [5, 6]],
    )
    meta = build_paged_metadata(layout, torch.device("cpu"))
    assert meta.positions.tolist() == [5, 16, 0, 1, 2, 17, 18]
    assert meta.slot_mapping.tolist() == [69, 32, 48, 49, 50, 97, 98]
