"""The attention-backend interface: what the model runner asks of a backend.

A backend turns one step's batch layout into the metadata that the model's layers read. An
attention-free model (Mamba) gets the placeholder backend, whose metadata is only what the
state-space mixers need (`mamba_metadata.MambaMetadata`); a hybrid would get a paged attention
backend whose metadata adds block tables.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class StepLayout:
    """One step's flat batch, decodes first then prefill chunks (plain Python lists).

    Attributes:
        decode_slots: the state slot of each decoding sequence (one token each).
        prefill_lens: tokens of each prefill chunk.
        prefill_slots: the state slot of each prefill chunk.
        prefill_context_lens: tokens of each prefilling sequence computed before this step.
    """

    decode_slots: list[int]
    prefill_lens: list[int]
    prefill_slots: list[int]
    prefill_context_lens: list[int]


class AttentionMetadata:
    """Base class of a backend's per-step metadata."""


class AttentionBackend(ABC):
    """A backend: the builder of per-step metadata."""

    @staticmethod
    @abstractmethod
    def build_metadata(layout: StepLayout, device: torch.device) -> AttentionMetadata:
        """Builds the tensors the layers read for this step."""
