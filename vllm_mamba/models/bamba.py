"""Bamba (`BambaForCausalLM`: `ibm-ai-platform/Bamba-9B`, `Bamba-9B-v2`).

A hybrid of Mamba2 and attention layers: layer `i` is attention when `i` is in
`attn_layer_indices` (transformers' `layers_block_type`), else Mamba2. Each layer is pre-norm
twice (`input_layernorm` before the mixer, `pre_ff_layernorm` before the gated MLP
`feed_forward`), with plain residuals.

- Mamba2 layers are the SSD mixer (`mamba.*`: `in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`,
  `norm`, `out_proj`), grouped gated RMSNorm, state in `mamba_cache`.
- Attention layers rotate queries and keys with RoPE on the first half of each head
  (`partial_rotary_factor` 0.5, hard-coded by transformers' config), GQA, scale
  `head_dim ** -0.5`, optional biases (`attention_bias`); keys and values in the paged KV
  cache.

Names are the checkpoints' (`model.embed_tokens`, `model.layers.N.mamba.*`,
`model.layers.N.self_attn.{q,k,v,o}_proj`, `model.layers.N.feed_forward.{gate,up,down}_proj`,
`model.final_layernorm`, `lm_head`). Bamba-9B: 32 layers of hidden size 4096, attention at
layers 9, 18 and 27 (32 query and 8 key/value heads), Mamba2 with 128 heads of 64, d_state
128, one group, conv 4, chunk 256.

Tensor parallelism (`tp`): Mamba2 by heads, attention by heads, the MLP's `gate_proj` and
`up_proj` column-parallel and `down_proj` row-parallel, vocabulary-parallel embedding and head.

Glossary: T tokens in the step, H hidden size, F feed-forward size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mamba2_mixer import Mamba2Mixer
from vllm_mamba.layers.parallel_linear import column_linear, row_linear, vocab_embedding
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding, rope_settings
from vllm_mamba.layers.self_attention import SelfAttention
from vllm_mamba.mamba_cache import LayerState, MambaCache
from vllm_mamba.models.mamba2_hybrid import (
    Mamba2HybridForCausalLM,
    check_mamba2_args,
    check_silu,
    mamba2_args_from_mamba_prefix,
)
from vllm_mamba.ops.table import MambaOps


def is_attention_layer(config: Any, index: int) -> bool:
    """Layer `index` is attention (else Mamba2)."""
    return index in (getattr(config, "attn_layer_indices", None) or [])


def make_rotary(config: Any, head_dim: int) -> RotaryEmbedding:
    """The config's RoPE over `head_dim`-wide heads."""
    base, rot_dim = rope_settings(config, head_dim)
    return RotaryEmbedding(head_dim, rot_dim, config.max_position_embeddings, base)


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`, with optional biases."""

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        bias: bool,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.gate_proj = column_linear(hidden_size, [ffn_size], bias, ops, tp)
        self.up_proj = column_linear(hidden_size, [ffn_size], bias, ops, tp)
        self.down_proj = row_linear(ffn_size, hidden_size, bias, ops, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BambaLayer(nn.Module):
    """Norm, mixer (`mamba` or `self_attn`), residual; norm, gated MLP, residual."""

    def __init__(self, config: Any, index: int, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.is_attention = is_attention_layer(config, index)
        if self.is_attention:
            head_dim = BambaForCausalLM.head_dim(config)
            self.self_attn = SelfAttention(
                config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                head_dim, bias=config.attention_bias, scale=head_dim**-0.5,
                rotary=make_rotary(config, head_dim), ops=ops, tp=tp,
            )  # fmt: skip
        else:
            self.mamba = Mamba2Mixer(**BambaForCausalLM.mamba2_args(config), ops=ops, tp=tp)
        bias = getattr(config, "mlp_bias", False)
        self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size, bias, ops, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, state: LayerState | None, meta: PagedMetadata
    ) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`; `state` is the Mamba2 layer's cache view."""
        normed = self.input_layernorm(hidden)
        if self.is_attention:
            hidden = hidden + self.self_attn(normed, meta)
        else:
            hidden = hidden + self.mamba(normed, state, meta)
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


class BambaModel(nn.Module):
    """Embeddings, the layers and the final norm (`model.*` in the checkpoints)."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            BambaLayer(config, i, ops, tp) for i in range(config.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class BambaForCausalLM(Mamba2HybridForCausalLM):
    """Bamba language model: Mamba2 and RoPE attention layers."""

    supports_tensor_parallel = True

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        check_silu(config)
        args = self.mamba2_args(config)
        check_mamba2_args(args, int(config.mamba_expand * config.hidden_size))
        self.model = BambaModel(config, ops, tp)
        self.init_lm_head(config, ops, tp)

    @classmethod
    def attention_layers(cls, config: Any) -> list[bool]:
        return [is_attention_layer(config, i) for i in range(config.num_hidden_layers)]

    @classmethod
    def mamba_layers(cls, config: Any) -> list[bool]:
        return [not a for a in cls.attention_layers(config)]

    @classmethod
    def mamba2_args(cls, config: Any) -> dict[str, Any]:
        return mamba2_args_from_mamba_prefix(config)

    def forward(
        self, input_ids: torch.Tensor, cache: MambaCache, meta: PagedMetadata
    ) -> torch.Tensor:
        """Runs the step's tokens `input_ids (T,)`; returns normed hidden states `(T, H)`."""
        hidden = self.model.embed_tokens(input_ids)  # (T, H)
        for layer, index in zip(self.model.layers, self.state_index):
            hidden = layer(hidden, None if index is None else cache.layer(index), meta)
        return self.model.final_layernorm(hidden)
