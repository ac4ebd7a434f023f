"""Mamba2 (`Mamba2ForCausalLM`: `state-spaces/mamba2-*` converted to HF, Codestral Mamba).

Same layout as Mamba (`backbone.embeddings`, `backbone.layers.N.norm`, `backbone.layers.N.mixer.*`,
`backbone.norm_f`, `lm_head`) with the multi-head SSD mixer. Its per-slot state, described to
`mamba_cache` like every state-space model's, is conv `(I + 2 G N, K - 1)` and ssm `(NH, P, N)`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_mamba.attention.backends.placeholder import PlaceholderAttentionMetadata
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mamba2_mixer import Mamba2Mixer
from vllm_mamba.mamba_cache import MambaCache, MambaStateShape
from vllm_mamba.models.mamba import MambaForCausalLM
from vllm_mamba.ops.dispatch import MambaOps


def _conv_dim(config: Any) -> int:
    """Channels of the conv: x, B and C of all groups."""
    return config.num_heads * config.head_dim + 2 * config.n_groups * config.state_size


def _check_config(config: Any) -> None:
    """Raises ValueError for configs whose shapes do not fit together."""
    intermediate = int(config.expand * config.hidden_size)
    if intermediate != config.num_heads * config.head_dim:
        raise ValueError(
            f"Mamba2 config: expand * hidden_size ({intermediate}) must equal "
            f"num_heads * head_dim ({config.num_heads * config.head_dim})"
        )
    if config.num_heads % config.n_groups:
        raise ValueError(
            f"Mamba2 config: num_heads ({config.num_heads}) must be a multiple of "
            f"n_groups ({config.n_groups})"
        )


class Mamba2Block(nn.Module):
    """Pre-norm residual block around a Mamba2 mixer."""

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(config.residual_in_fp32)
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            head_dim=config.head_dim,
            n_groups=config.n_groups,
            state_size=config.state_size,
            conv_kernel=config.conv_kernel,
            chunk_size=config.chunk_size,
            time_step_limit=tuple(config.time_step_limit),
            use_bias=config.use_bias,
            use_conv_bias=config.use_conv_bias,
            norm_eps=config.layer_norm_epsilon,
            ops=ops,
        )

    def forward(
        self, hidden: torch.Tensor, state: Any, meta: PlaceholderAttentionMetadata
    ) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`; the residual stream is float32 with residual_in_fp32."""
        residual = hidden.float() if self.residual_in_fp32 else hidden
        mixed = self.mixer(self.norm(hidden.to(self.norm.weight.dtype)), state, meta)
        return residual + mixed


class Mamba2Backbone(nn.Module):
    """Embeddings, the blocks and the final norm."""

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Mamba2Block(config, ops) for _ in range(config.num_hidden_layers)]
        )
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class Mamba2ForCausalLM(nn.Module):
    """Mamba2 language model; attention-free, so it runs with the placeholder backend."""

    is_attention_free = True

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        _check_config(config)
        self.config = config
        self.backbone = Mamba2Backbone(config, ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Shares the embedding with the LM head when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @staticmethod
    def get_mamba_state_shape(config: Any, dtype: torch.dtype) -> MambaStateShape:
        """Per-slot state: conv `(CD, K - 1)` in the model dtype, ssm `(NH, P, N)` in float32."""
        return MambaStateShape(
            num_layers=config.num_hidden_layers,
            conv_shape=(_conv_dim(config), config.conv_kernel - 1),
            ssm_shape=(config.num_heads, config.head_dim, config.state_size),
            conv_dtype=dtype,
            ssm_dtype=torch.float32,
        )

    remap_weight_name = staticmethod(MambaForCausalLM.remap_weight_name)

    def process_weights_after_loading(self) -> None:
        """Lets each mixer precompute its derived tensors."""
        for layer in self.backbone.layers:
            layer.mixer.process_weights_after_loading()

    def forward(
        self, input_ids: torch.Tensor, cache: MambaCache, meta: PlaceholderAttentionMetadata
    ) -> torch.Tensor:
        """Runs the step's tokens `input_ids (T,)`; returns normed hidden states `(T, H)`."""
        hidden = self.backbone.embeddings(input_ids)  # (T, H)
        for i, layer in enumerate(self.backbone.layers):
            hidden = layer(hidden, cache.layer(i), meta)
        return self.backbone.norm_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden (R, H)` of the sampled positions -> float32 logits `(R, V)`."""
        return self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()
