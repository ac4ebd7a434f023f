"""Granite 4.0-H (`GraniteMoeHybridForCausalLM`: `ibm-granite/granite-4.0-h-tiny`, `-h-small`,
`-h-micro`, `granite-4.0-h-1b` / `-350m`).

A hybrid of Mamba2 and attention layers by `layer_types` (`mamba` / `attention`, which
transformers spells `linear_attention` / `full_attention`). Each layer: norm, mixer, residual
scaled by `residual_multiplier`; norm (`post_attention_layernorm`), feed-forward, residual
scaled again. The feed-forward is a sparse MoE (`block_sparse_moe`, `num_local_experts > 0`)
plus a shared gated MLP (`shared_mlp`), or the shared MLP alone (dense models). The embeddings
are scaled by `embedding_multiplier`, the attention softmax by `attention_multiplier` (instead of
`head_dim ** -0.5`), and the logits divided by `logits_scaling`. Attention uses RoPE when
`position_embedding_type == "rope"`, else no position embedding (the 4.0-H models: NoPE).

- The router is transformers': float32 logits `x @ router.layer.weight^T`, their top-k, a
  softmax over those k; expert `e` computes `silu(g) * u` with `g, u` the halves of
  `input_linear.weight[e] @ x`, then `output_linear.weight[e]` (`layers.moe`; the
  checkpoint's `router.layer` and stacked matrices are renamed onto `router` and `experts`).
- The Mamba2 layers are the SSD mixer (`mamba.*`), state in `state_cache`.

Names are the checkpoints' (`model.embed_tokens`, `model.layers.N.mamba.*`,
`model.layers.N.self_attn.{q,k,v,o}_proj`, `model.layers.N.block_sparse_moe.router.layer`,
`model.layers.N.block_sparse_moe.{input,output}_linear`, `model.layers.N.shared_mlp.{input,
output}_linear`, `model.norm`, `lm_head`). granite-4.0-h-tiny: 40 layers of hidden size 1536,
attention at 4 of them (12 query and 4 key/value heads, NoPE), 64 experts top-6 of size 512 and
a shared expert of 1024, Mamba2 with 48 heads of 64, d_state 128, one group, conv 4.

Tensor parallelism (`tp`): Mamba2 and attention by heads; the shared MLP's `input_linear`
(its gate and up halves each split) column-parallel and `output_linear` row-parallel; every
expert's matrices split the same way over F (the router is replicated and the experts' partial
sums all-reduced once); vocabulary-parallel embedding and head.

Glossary: T tokens in the step, H hidden size, E experts, k experts per token, F expert size,
S shared-expert size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mamba2_mixer import Mamba2Mixer
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.moe import ExpertRouter, RouterConfig, SparseMoE, StackedGatedExperts
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

MAMBA_TYPES = ("mamba", "linear_attention")
ATTENTION_TYPES = ("attention", "full_attention")
NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="norm")
# The checkpoint's MoE names -> this model's (`layers.moe.SparseMoE`'s router and experts).
_MOE_NAMES = {
    ".block_sparse_moe.router.layer.": ".block_sparse_moe.router.",
    ".block_sparse_moe.input_linear.": ".block_sparse_moe.experts.input_linear.",
    ".block_sparse_moe.output_linear.": ".block_sparse_moe.experts.output_linear.",
}


def layer_types(config: Any) -> list[str]:
    """The kind of each layer, checked."""
    types = list(getattr(config, "layer_types", None) or ["mamba"] * config.num_hidden_layers)
    unknown = sorted({t for t in types if t not in MAMBA_TYPES + ATTENTION_TYPES})
    if unknown or len(types) != config.num_hidden_layers:
        raise ValueError(
            f"layer_types must name {config.num_hidden_layers} layers, each one of "
            f"{MAMBA_TYPES + ATTENTION_TYPES}; got {types}"
        )
    return types


def _attention(config: Any, ops: MambaOps, tp: TensorParallel) -> SelfAttention:
    """Attention scaled by `attention_multiplier`, RoPE over whole heads or none (NoPE)."""
    head_dim = attention_head_dim(config)
    rotary = None
    if getattr(config, "position_embedding_type", None) == "rope":
        # transformers rotates whole heads
        rotary = RotaryEmbedding.from_config(config, head_dim, rot_dim=head_dim)
    return SelfAttention(
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
        bias=config.attention_bias, scale=config.attention_multiplier, rotary=rotary, ops=ops,
        tp=tp,
    )  # fmt: skip


def _ffns(config: Any, ops: MambaOps, tp: TensorParallel) -> list[tuple[str, nn.Module]]:
    """The MoE (when `num_local_experts > 0`) and the shared MLP, summed in that order."""
    hidden = config.hidden_size
    shared = GatedMLP(hidden, config.shared_intermediate_size, False, ops, tp,
                      merged=("input_linear", "output_linear"))  # fmt: skip
    if config.num_local_experts <= 0:
        return [("shared_mlp", shared)]
    route = RouterConfig("topk_softmax", config.num_local_experts, config.num_experts_per_tok)
    experts = StackedGatedExperts(config.num_local_experts, hidden, config.intermediate_size, tp)
    moe = SparseMoE(ExpertRouter(hidden, route, ops), experts, tp)
    return [("block_sparse_moe", moe), ("shared_mlp", shared)]


def _layer(config: Any, kind: str, ops: MambaOps, tp: TensorParallel) -> nn.Module:
    """Norm, mixer, scaled residual; norm, MoE + shared MLP, scaled residual."""
    hidden, eps = config.hidden_size, config.rms_norm_eps
    if kind in ATTENTION_TYPES:
        mixer = MixerPart("self_attn", _attention(config, ops, tp))
    else:
        args = mamba2_args_from_mamba_prefix(config)
        mixer = MixerPart("mamba", Mamba2Mixer(**args, ops=ops, tp=tp))
    return DecoderLayer(
        norm=("input_layernorm", RMSNorm(hidden, eps=eps)),
        mixers=[mixer],
        ffn_norm=("post_attention_layernorm", RMSNorm(hidden, eps=eps)),
        ffns=_ffns(config, ops, tp),
        residual_multiplier=config.residual_multiplier,
    )


class GraniteMoeHybridForCausalLM(CausalLM):
    """Granite 4.0-H language model: Mamba2 and attention layers, MoE with a shared expert."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        check_silu(config)
        check_mamba2_args(
            mamba2_args_from_mamba_prefix(config), int(config.mamba_expand * config.hidden_size)
        )
        pe = getattr(config, "position_embedding_type", None)
        if pe not in (None, "nope", "rope"):
            raise ValueError(f"position_embedding_type {pe!r} is not supported (rope or none)")
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[_layer(config, kind, ops, tp) for kind in layer_types(config)],
            norm_eps=config.rms_norm_eps,
            embedding_multiplier=config.embedding_multiplier,
        )  # fmt: skip
        self.logits_scaling = float(config.logits_scaling)

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """The checkpoint's MoE router and stacked experts onto `SparseMoE`'s names."""
        for old, new in _MOE_NAMES.items():
            if old in name:
                return name.replace(old, new)
        return name

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits divided by `logits_scaling`."""
        return logits / self.logits_scaling
