"""The attention-backend interface: what the model runner asks of a backend.

A backend names itself and turns one step's batch layout into the metadata that the model's
layers read. An attention-free model (Mamba) gets the placeholder backend, whose metadata
carries only what state-space mixers need; a hybrid would get a paged attention backend.
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

    @property
    def num_tokens(self) -> int:
        """Tokens in the flat batch."""
        return len(self.decode_slots) + sum(self.prefill_lens)


class AttentionMetadata:
    """Base class of a backend's per-step metadata."""


class AttentionBackend(ABC):
    """A backend: a name and a builder of per-step metadata."""

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        """The backend's name, as logged and selected."""

    @staticmethod
    @abstractmethod
    def build_metadata(layout: StepLayout, device: torch.device) -> AttentionMetadata:
        """Builds the tensors the layers read for this step."""
