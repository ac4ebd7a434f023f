"""Mamba (`MambaForCausalLM`, the `state-spaces/mamba-*-hf` checkpoints) for the engine.

Module names match the Hugging Face checkpoints (`backbone.embeddings`, `backbone.layers.N.norm`,
`backbone.layers.N.mixer.*`, `backbone.norm_f`, `lm_head`), so loading is an identity mapping.
One forward runs over the step's flat token batch `(T,)`; the LM head runs separately, only on
the positions that are sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mamba_mixer import MambaMixer
from vllm_mamba.layers.parallel_linear import lm_head, vocab_embedding
from vllm_mamba.mamba_cache import MambaCache, MambaStateShape
from vllm_mamba.ops.table import MambaOps


class MambaBlock(nn.Module):
    """Pre-norm residual block around a mixer."""

    def __init__(self, config: Any, mixer: nn.Module) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(config.residual_in_fp32)
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = mixer

    def forward(self, hidden: torch.Tensor, state: Any, meta: MambaMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`; the residual stream is float32 with residual_in_fp32."""
        fused = self.mixer.decode_block(hidden, self.norm, self.residual_in_fp32, state, meta)
        if fused is not None:  # a decode-only step in one kernel call (`fused_decode_layer`)
            return fused
        residual = hidden.float() if self.residual_in_fp32 else hidden
        mixed = self.mixer(self.norm(hidden.to(self.norm.weight.dtype)), state, meta)
        return residual + mixed


class MambaBackbone(nn.Module):
    """Embeddings, the blocks (one new mixer each) and the final norm."""

    def __init__(
        self, config: Any, make_mixer: Callable[[], nn.Module], tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.embeddings = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            [MambaBlock(config, make_mixer()) for _ in range(config.num_hidden_layers)]
        )
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class MambaForCausalLM(nn.Module):
    """Mamba language model; attention-free, so it runs with the placeholder backend."""

    is_attention_free = True
    supports_tensor_parallel = True

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported; the kernels apply SiLU")
        self.config = config
        self.backbone = MambaBackbone(config, lambda: self.make_mixer(config, ops, tp), tp)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, ops, tp)
        self.tie_weights()

    @staticmethod
    def make_mixer(config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> nn.Module:
        """One layer's mixer (this rank's shard of it); subclasses with another mixer (Mamba2,
        FalconMamba) override this."""
        return MambaMixer(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            state_size=config.state_size,
            conv_kernel=config.conv_kernel,
            time_step_rank=int(config.time_step_rank),
            use_bias=config.use_bias,
            use_conv_bias=config.use_conv_bias,
            ops=ops,
            tp=tp,
        )

    def tie_weights(self) -> None:
        """Shares the embedding with the LM head when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @staticmethod
    def get_mamba_state_shape(config: Any, dtype: torch.dtype) -> MambaStateShape:
        """Per-slot state: conv `(I, K - 1)` in the model dtype, ssm `(I, N)` in float32."""
        return MambaStateShape(
            num_layers=config.num_hidden_layers,
            conv_shape=(config.intermediate_size, config.conv_kernel - 1),
            ssm_shape=(config.intermediate_size, config.state_size),
            conv_dtype=dtype,
            ssm_dtype=torch.float32,
        )

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """Checkpoint name -> parameter name (older checkpoints say `embedding`)."""
        return name.replace("backbone.embedding.", "backbone.embeddings.")

    def process_weights_after_loading(self) -> None:
        """Lets each mixer precompute its derived tensors."""
        for layer in self.backbone.layers:
            layer.mixer.process_weights_after_loading()

    def forward(
        self, input_ids: torch.Tensor, cache: MambaCache, meta: MambaMetadata
    ) -> torch.Tensor:
        """Runs the step's tokens `input_ids (T,)`; returns normed hidden states `(T, H)`."""
        hidden = self.backbone.embeddings(input_ids)  # (T, H)
        for i, layer in enumerate(self.backbone.layers):
            hidden = layer(hidden, cache.layer(i), meta)
        return self.backbone.norm_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden (R, H)` of the sampled positions -> float32 logits `(R, V)`."""
        return self.lm_head(hidden.to(self.lm_head.compute_dtype)).float()
