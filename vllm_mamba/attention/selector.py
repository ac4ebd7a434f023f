"""Chooses the attention backend for a model class."""

from __future__ import annotations

from vllm_mamba.attention.backend import AttentionBackend
from vllm_mamba.attention.backends.paged import PagedAttentionBackend
from vllm_mamba.attention.backends.placeholder import PlaceholderAttentionBackend


def select_attention_backend(model_cls: type) -> type[AttentionBackend]:
    """Returns the backend for `model_cls`.

    Args:
        model_cls: a model class; `is_attention_free = True` marks a pure state-space model
            (the placeholder backend: no KV cache); any other model has attention layers and
            gets the paged backend (KV blocks beside the state slots).

    Returns:
        The backend class.
    """
    if getattr(model_cls, "is_attention_free", False):
        return PlaceholderAttentionBackend
    return PagedAttentionBackend
