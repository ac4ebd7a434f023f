"""The attention-backend interface: what the model runner asks of a backend.

A backend turns one step's batch layout into the metadata that the model's layers read. An
attention-free model (Mamba) gets the placeholder backend, whose metadata is only what the
state-space mixers need (`mamba_metadata.MambaMetadata`); a hybrid gets the paged attention
backend (`backends/paged.py`), whose metadata adds block tables, slot mappings and sequence
lengths for the attention layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class StepLayout:
    """One step's flat batch, decodes first then prefill chunks (plain Python lists).

    Attributes:
        decode_slots: the state slot of each decoding sequence (one token each).
        prefill_lens: tokens of each prefill chunk.
        prefill_slots: the state slot of each prefill chunk.
        prefill_context_lens: tokens of each prefilling sequence computed before this step.
        decode_context_lens: tokens of each decoding sequence computed before this step
            (paged backend only).
        block_size: tokens per KV block (paged backend only; 0 without a KV cache).
        decode_block_tables: the KV blocks of each decoding sequence (paged backend only;
            with `kv_groups` G > 1, each group's logical block `i` at index `i * G + g`).
        prefill_block_tables: the KV blocks of each prefilling sequence (as decode's).
        kv_groups: the KV groups (`kv_cache.KVGroups`) the tables interleave (paged only).
        prefill_prompt_lens: the prompt length of each prefilling sequence (paged backend
            only; a RoPE whose frequencies follow the length rotates prompt tokens at it);
            empty: at each chunk's end.
        decode_waves: with speculative decoding, the decode rows per wave (see
            `mamba_metadata.MambaMetadata`); empty otherwise.
        decode_chain_src / decode_chain_dst: with waves, per decode row the slot its state
            is read from and written to: position w of a chain writes its own spare slot, its
            last position the sequence's slot (`decode_slots`).
        rope_positions: M-RoPE steps (paged only): the three rows (time, height, width) of
            rotary positions of every token in flat order; None: each token rotates at its
            position.
    """

    decode_slots: list[int]
    prefill_lens: list[int]
    prefill_slots: list[int]
    prefill_context_lens: list[int]
    decode_context_lens: list[int] = field(default_factory=list)
    block_size: int = 0
    decode_block_tables: list[list[int]] = field(default_factory=list)
    prefill_block_tables: list[list[int]] = field(default_factory=list)
    kv_groups: int = 1
    prefill_prompt_lens: list[int] = field(default_factory=list)
    decode_waves: list[int] = field(default_factory=list)
    decode_chain_src: list[int] = field(default_factory=list)
    decode_chain_dst: list[int] = field(default_factory=list)
    rope_positions: list[list[int]] | None = None


class AttentionMetadata:
    """Base class of a backend's per-step metadata."""


class AttentionBackend(ABC):
    """A backend: the builder of per-step metadata.

    Attributes:
        decode_cuda_graphs: a decode-only step's metadata differs from another's of the same
            batch size only in `decode_state_indices` (`MambaMetadata`), so the forward can be
            captured once per batch size and replayed (`worker.cuda_graphs`). False where the
            metadata carries more per step (block tables, context lengths).
    """

    decode_cuda_graphs: bool = False

    @staticmethod
    @abstractmethod
    def build_metadata(layout: StepLayout, device: torch.device) -> AttentionMetadata:
        """Builds the tensors the layers read for this step."""
