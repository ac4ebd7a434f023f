"""Bamba (`BambaForCausalLM`: `ibm-ai-platform/Bamba-9B`, `Bamba-9B-v2`).

A hybrid of Mamba2 and attention layers: layer `i` is attention when `i` is in
`attn_layer_indices` (transformers' `layers_block_type`), else Mamba2. Each layer is pre-norm
twice (`input_layernorm` before the mixer, `pre_ff_layernorm` before the gated MLP
`feed_forward`), with plain residuals.

- Mamba2 layers are the SSD mixer (`mamba.*`: `in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`,
  `norm`, `out_proj`), grouped gated RMSNorm, state in `state_cache`.
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

from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mamba2_mixer import Mamba2Mixer
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.layers.self_attention import SelfAttention
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.mamba2_args import (
    attention_head_dim,
    check_mamba2_args,
    check_silu,
    mamba2_args_from_mamba_prefix,
)
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="final_layernorm")


def is_attention_layer(config: Any, index: int) -> bool:
    """Layer `index` is attention (else Mamba2)."""
    return index in (getattr(config, "attn_layer_indices", None) or [])


def make_rotary(config: Any, head_dim: int) -> RotaryEmbedding:
    """The config's RoPE over `head_dim`-wide heads."""
    return RotaryEmbedding.from_config(config, head_dim)


def _mixer(config: Any, index: int, ops: MambaOps, tp: TensorParallel) -> MixerPart:
    """Layer `index`'s mixer: RoPE attention (`self_attn`) or Mamba2 (`mamba`)."""
    if not is_attention_layer(config, index):
        args = mamba2_args_from_mamba_prefix(config)
        return MixerPart("mamba", Mamba2Mixer(**args, ops=ops, tp=tp))
    head_dim = attention_head_dim(config)
    attn = SelfAttention(
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
        bias=config.attention_bias, scale=head_dim**-0.5, rotary=make_rotary(config, head_dim),
        ops=ops, tp=tp,
    )  # fmt: skip
    return MixerPart("self_attn", attn)


def _layer(config: Any, index: int, ops: MambaOps, tp: TensorParallel) -> nn.Module:
    """Norm, mixer, residual; norm, gated MLP (`feed_forward`), residual."""
    hidden, eps = config.hidden_size, config.rms_norm_eps
    mlp = GatedMLP(hidden, config.intermediate_size, getattr(config, "mlp_bias", False), ops, tp)
    return DecoderLayer(
        norm=("input_layernorm", RMSNorm(hidden, eps=eps)),
        mixers=[_mixer(config, index, ops, tp)],
        ffn_norm=("pre_ff_layernorm", RMSNorm(hidden, eps=eps)),
        ffns=[("feed_forward", mlp)],
    )


class BambaForCausalLM(CausalLM):
    """Bamba language model: Mamba2 and RoPE attention layers."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        check_silu(config)
        args = mamba2_args_from_mamba_prefix(config)
        check_mamba2_args(args, int(config.mamba_expand * config.hidden_size))
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[_layer(config, i, ops, tp) for i in range(config.num_hidden_layers)],
            norm_eps=config.rms_norm_eps,
        )  # fmt: skip
