"""Chooses the attention backend for a built model."""

from __future__ import annotations

from vllm_mamba.attention.backend import AttentionBackend
from vllm_mamba.attention.backends.paged import PagedAttentionBackend
from vllm_mamba.attention.backends.placeholder import PlaceholderAttentionBackend


def select_attention_backend(has_kv_cache: bool) -> type[AttentionBackend]:
    """Returns the backend for a model with (or without) attention layers.

    Args:
        has_kv_cache: the built model has attention layers, so a paged KV cache beside the
            state slots (the paged backend); without, it is attention-free (the placeholder
            backend: `MambaMetadata` only).

    Returns:
        The backend class.
    """
    return PagedAttentionBackend if has_kv_cache else PlaceholderAttentionBackend
