"""MiniMax-Text-01 / MiniMax-M1 (`MiniMaxForCausalLM`: `MiniMaxAI/MiniMax-Text-01-hf`).

Lightning-attention and softmax-attention layers by `layer_types` (`linear_attention` /
`full_attention`; transformers' default alternates them from a softmax layer), each normed
twice with RMSNorms (`input_layernorm`, `post_attention_layernorm`, `rms_norm_eps`). The
residual of each stage is its normed input, both scaled by the stage's factors
(`layers.decoder_layer.NormedResidual`):

    x = input_layernorm(h);          h = alpha_a * x + beta_a * mixer(x)
    y = post_attention_layernorm(h); h = mlp_alpha_factor * y + mlp_beta_factor * moe(y)

with `(alpha_a, beta_a)` the `linear_attn_*_factor`s or the `full_attn_*_factor`s by the layer's
kind; the final norm is `norm`.

- Lightning layers (`self_attn.*`, `layers.lightning_attention.LightningAttention`): linear
  attention with a fixed decay per head and layer, an RMSNorm over all heads and a sigmoid
  output gate.
- Softmax layers (`self_attn.*`): `q_proj`, `k_proj`, `v_proj`, `o_proj` without biases, GQA,
  scale `D ** -0.5`, RoPE over whole heads (transformers' MiniMax rotates all `head_dim`
  channels whatever `partial_rotary_factor` says), a sliding window of `sliding_window` tokens
  (the query's own included) on every softmax layer when the config sets one.
- Feed-forward (`mlp.*`, saved as `block_sparse_moe.*`): Mixtral's MoE on every layer, a router
  `gate` (softmax in float32, top-`num_experts_per_tok`, renormalised over the k), experts
  `experts.E.{w1,w3,w2}` (gate, up, down) of `intermediate_size` with `hidden_act`.

Checkpoint names beside those: transformers' in-memory names load too (`mlp.*`, the stacked
`mlp.experts.gate_up_proj` / `down_proj`: `expand_weight`); the lightning layers' derived
buffers (`slope_rate`, `query_decay`, `key_decay`, `diagonal_decay`) are recomputed, not loaded.
MiniMax-Text-01: 80 layers of hidden size 6144 (every 8th softmax), 64 heads of 128 (softmax
GQA with 8 KV heads), 32 experts of 9216, top-2, vocabulary 200064.

Tensor parallelism (`tp`): lightning and softmax layers by heads, every expert column- then
row-parallel, the router replicated; vocabulary-parallel embedding and head.

Glossary: E experts, k experts per token, D head dim.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart, NormedResidual
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.lightning_attention import LightningAttention
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.moe import ExpertList, ExpertRouter, RouterConfig, SparseMoE
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.layers.self_attention import SelfAttention
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.layer_types import layer_types
from vllm_mamba.models.qwen3_5 import Qwen3_5ForCausalLM
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="norm")
_EXPERT_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(w[123])\.")
_DERIVED = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _softmax_attention(config: Any, ops: MambaOps, tp: TensorParallel) -> SelfAttention:
    """GQA with RoPE over whole heads and the config's sliding window (None: full)."""
    head_dim = _head_dim(config)
    rotary = RotaryEmbedding.from_config(config, head_dim, rot_dim=head_dim)
    return SelfAttention(
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
        bias=False, scale=head_dim**-0.5, rotary=rotary, ops=ops,
        sliding_window=config.sliding_window, tp=tp,
    )  # fmt: skip


def _moe(config: Any, ops: MambaOps, tp: TensorParallel) -> SparseMoE:
    """Mixtral's experts: softmax router, top-k renormalised, SwiGLU experts."""
    hidden, num_experts = config.hidden_size, config.num_local_experts
    route = RouterConfig("softmax_topk", num_experts, config.num_experts_per_tok, renormalize=True)
    experts = ExpertList(
        GatedMLP(
            hidden, config.intermediate_size, False, ops, tp, act=config.hidden_act, reduce=False
        )
        for _ in range(num_experts)
    )
    return SparseMoE(ExpertRouter(hidden, route, ops), experts, tp, names=("gate", "experts"))


def _layer(config: Any, index: int, kind: str, ops: MambaOps, tp: TensorParallel) -> nn.Module:
    """Norm, lightning or softmax attention, scaled normed residual; norm, MoE, likewise."""
    hidden, eps = config.hidden_size, config.rms_norm_eps
    if kind == "linear_attention":
        mixer: nn.Module = LightningAttention(
            hidden, config.num_attention_heads, _head_dim(config), index,
            config.num_hidden_layers, ops, tp, act=config.hidden_act,
        )  # fmt: skip
        alpha, beta = config.linear_attn_alpha_factor, config.linear_attn_beta_factor
    else:
        mixer = _softmax_attention(config, ops, tp)
        alpha, beta = config.full_attn_alpha_factor, config.full_attn_beta_factor
    mlp = NormedResidual(float(config.mlp_alpha_factor), float(config.mlp_beta_factor))
    return DecoderLayer(
        norm=("input_layernorm", RMSNorm(hidden, eps=eps)),
        mixers=[MixerPart("self_attn", mixer)],
        ffn_norm=("post_attention_layernorm", RMSNorm(hidden, eps=eps)),
        ffns=[("mlp", _moe(config, ops, tp))],
        normed_residuals=(NormedResidual(float(alpha), float(beta)), mlp),
    )


class MiniMaxForCausalLM(CausalLM):
    """MiniMax-Text-01: lightning and softmax attention layers, each with Mixtral's MoE."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        kinds = layer_types(config)
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[_layer(config, i, kind, ops, tp) for i, kind in enumerate(kinds)],
            norm_eps=config.rms_norm_eps,
        )  # fmt: skip

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """The checkpoints' `block_sparse_moe` and experts' `w1/w2/w3` onto this model's names."""
        name = name.replace(".block_sparse_moe.", ".mlp.", 1)
        return _EXPERT.sub(lambda m: f".mlp.experts.{m[1]}.{_EXPERT_PARTS[m[2]]}.", name)

    @staticmethod
    def expand_weight(name: str, tensor: Any) -> list[tuple[str, Any]]:
        """Nothing for the lightning layers' derived buffers (recomputed from the config);
        transformers' stacked experts one by one, as Qwen3.5's."""
        if name.rpartition(".")[2] in _DERIVED and ".self_attn." in name:
            return []
        return Qwen3_5ForCausalLM.expand_weight(name, tensor)
