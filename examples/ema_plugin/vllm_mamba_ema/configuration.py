"""`EmaConfig`: the transformers config of the toy EMA language model (`model_type="ema_lm"`)."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class EmaConfig(PretrainedConfig):
    """Sizes of `EmaForCausalLM`.

    Args:
        vocab_size: tokens in the vocabulary (V).
        hidden_size: residual stream width (H).
        num_hidden_layers: decoder layers.
        ema_size: channels of each EMA mixer (C).
        intermediate_size: width of each gated MLP (F).
        rms_norm_eps: epsilon of every RMS norm.
        tie_word_embeddings: share the embedding with the LM head.
        max_position_embeddings: the longest sequence the engine admits.
    """

    model_type = "ema_lm"

    def __init__(
        self,
        vocab_size: int = 50280,
        hidden_size: int = 64,
        num_hidden_layers: int = 2,
        ema_size: int = 96,
        intermediate_size: int = 128,
        rms_norm_eps: float = 1e-5,
        tie_word_embeddings: bool = True,
        max_position_embeddings: int = 2048,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.ema_size = ema_size
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        kwargs.setdefault("architectures", ["EmaForCausalLM"])
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
