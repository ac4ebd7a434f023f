"""Chooses the attention backend for a model class."""

from __future__ import annotations

from vllm_mamba.attention.backend import AttentionBackend
from vllm_mamba.attention.backends.placeholder import PlaceholderAttentionBackend


def select_attention_backend(model_cls: type) -> type[AttentionBackend]:
    """Returns the backend for `model_cls`.

    Args:
        model_cls: a model class; `is_attention_free = True` marks a pure state-space model.

    Returns:
        The backend class.

    Raises:
        ValueError: the model needs attention, which no backend here provides yet.
    """
    if getattr(model_cls, "is_attention_free", False):
        return PlaceholderAttentionBackend
    raise ValueError(
        f"{model_cls.__name__} has attention layers; only attention-free models are supported"
    )
