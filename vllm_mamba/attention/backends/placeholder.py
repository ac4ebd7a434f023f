"""The placeholder attention backend for attention-free models: no KV cache at all.

A pure state-space model has no attention layers, so its step metadata is only what the
mixers read (`MambaMetadata`).
"""

from __future__ import annotations

import torch

from vllm_mamba.attention.backend import AttentionBackend, StepLayout
from vllm_mamba.attention.mamba_metadata import MambaMetadata, build_mamba_metadata


class PlaceholderAttentionBackend(AttentionBackend):
    """Selected for models with no attention layers; its decode steps can be captured (the
    metadata of a decode-only step is its state slots and fixed-size counts)."""

    decode_cuda_graphs = True

    @staticmethod
    def build_metadata(layout: StepLayout, device: torch.device) -> MambaMetadata:
        return build_mamba_metadata(layout, device)
