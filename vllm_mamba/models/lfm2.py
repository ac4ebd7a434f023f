"""Liquid LFM2 and LFM2-MoE (`Lfm2ForCausalLM`: `LiquidAI/LFM2-350M` ... `LFM2-2.6B`;
`Lfm2MoeForCausalLM`: `LiquidAI/LFM2-8B-A1B`).

Short-conv and attention layers by `layer_types` (`conv` / `full_attention`; LFM2's config
derives it from `full_attn_idxs`, LFM2-MoE's has no default, so a checkpoint must name them).
Every layer is pre-norm twice with plain RMSNorms (`norm_eps`) and plain residuals:

    h = h + mixer(operator_norm(h))           # mixer: `conv` or `self_attn`
    h = h + feed_forward(ffn_norm(h))

and the final norm is `embedding_norm`; the head is tied to the embedding unless the config
says otherwise (`tie_word_embeddings`, or the older `tie_embedding`).

- Short-conv layers (`conv.*`): `in_proj` -> `[B | C | x]`, `y = out_proj(C * conv(B * x))`
  with a depthwise causal conv of width `conv_L_cache` and no activation; `conv_bias` gives
  `in_proj`, `conv.conv` and `out_proj` biases (`layers.short_conv`).
- Attention layers (`self_attn.*`): `q_proj`, `k_proj`, `v_proj`, `out_proj`, RMSNorms per
  head of the queries and keys (`q_layernorm`, `k_layernorm`) before RoPE over whole heads,
  GQA, softmax scale `D ** -0.5`, no biases.
- Feed-forward (`feed_forward.*`): a SwiGLU `w2(silu(w1(x)) * w3(x))`. LFM2's width is derived
  from `intermediate_size` when `block_auto_adjust_ff_dim` (as transformers does): `2/3` of it,
  times `block_ffn_dim_multiplier` and rounded up to a multiple of `block_multiple_of` when the
  multiplier is set (LFM2-350M: 6656 -> 4608). LFM2-MoE's first `num_dense_layers` layers are
  dense of `intermediate_size` (no adjustment); the others are the MoE: a sigmoid router
  `gate`, experts chosen by score plus `expert_bias` (when `use_expert_bias`; the bias only
  selects), weighted by their scores, renormalised over the k when `norm_topk_prob` (sum plus
  1e-6), times `routed_scaling_factor`, experts `experts.E.{w1,w2,w3}` of
  `moe_intermediate_size`, no shared expert.

Checkpoint names -> this model's (`remap_weight_name`): the SwiGLU's `w1`, `w3`, `w2` are
`gate_proj`, `up_proj`, `down_proj` (`layers.mlp.GatedMLP`); the attention's `q_layernorm`,
`k_layernorm`, `out_proj` are `q_norm`, `k_norm`, `o_proj` (`layers.self_attention`); the MoE's
`feed_forward.expert_bias` is its router's `gate.e_score_correction_bias`. The released MoE
checkpoints (and transformers' `save_pretrained`) hold the experts one by one; a checkpoint with
transformers' fused `experts.gate_up_proj (E, 2F, H)` (`[w1 | w3]` rows) and
`experts.down_proj (E, H, F)` loads too (`expand_weight`). LFM2-350M: 16 layers of hidden size
1024 (6 attention: 16 query and 8 KV heads of 64), conv width 3, vocabulary 65536.

Tensor parallelism (`tp`): short convs by channels, attention by heads, the MLPs and every
expert column- then row-parallel; the router replicated; vocabulary-parallel embedding and head.

Glossary: E experts, k experts per token, F expert width, H hidden size, D head dim.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.moe import ExpertList, ExpertRouter, RouterConfig, SparseMoE
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.layers.self_attention import SelfAttention
from vllm_mamba.layers.short_conv import ShortConv
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.layer_types import layer_types
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="embedding_norm")
KINDS = ("conv", "full_attention")
ROUTER_RENORM_EPS = 1e-6  # transformers' LFM2-MoE router adds it to the sum of the k weights
_SWIGLU = re.compile(r"(\.feed_forward\.(?:experts\.\d+\.)?)w([123])\.")
_SWIGLU_NAMES = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}
_RENAMED = {
    ".self_attn.q_layernorm.": ".self_attn.q_norm.",
    ".self_attn.k_layernorm.": ".self_attn.k_norm.",
    ".self_attn.out_proj.": ".self_attn.o_proj.",
    ".feed_forward.expert_bias": ".feed_forward.gate.e_score_correction_bias",
}


def dense_ffn_size(config: Any) -> int:
    """LFM2's SwiGLU width from `intermediate_size`, as transformers derives it."""
    size = config.intermediate_size
    if not getattr(config, "block_auto_adjust_ff_dim", False):
        return size
    size = int(2 * size / 3)
    if config.block_ffn_dim_multiplier is not None:
        size = int(config.block_ffn_dim_multiplier * size)
        multiple = config.block_multiple_of
        size = multiple * ((size + multiple - 1) // multiple)
    return size


def _attention(config: Any, ops: MambaOps, tp: TensorParallel) -> SelfAttention:
    """Attention with per-head RMSNorms of the queries and keys and RoPE over whole heads."""
    heads, eps = config.num_attention_heads, config.norm_eps
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rotary = RotaryEmbedding.from_config(config, head_dim)
    return SelfAttention(
        config.hidden_size, heads, config.num_key_value_heads, head_dim, bias=False,
        scale=head_dim**-0.5, rotary=rotary, ops=ops, q_norm=RMSNorm(head_dim, eps),
        k_norm=RMSNorm(head_dim, eps), tp=tp,
    )  # fmt: skip


def _sparse_moe(config: Any, ops: MambaOps, tp: TensorParallel) -> SparseMoE:
    """The sigmoid-routed experts (see the module docstring)."""
    hidden, num_experts = config.hidden_size, config.num_experts
    route = RouterConfig(
        "sigmoid_topk", num_experts, config.num_experts_per_tok,
        renormalize=bool(config.norm_topk_prob), scaling=float(config.routed_scaling_factor),
        score_bias=bool(config.use_expert_bias), renorm_eps=ROUTER_RENORM_EPS,
    )  # fmt: skip
    experts = ExpertList(
        GatedMLP(hidden, config.moe_intermediate_size, False, ops, tp, reduce=False)
        for _ in range(num_experts)
    )
    return SparseMoE(ExpertRouter(hidden, route, ops), experts, tp, names=("gate", "experts"))


def _layer(config: Any, kind: str, ffn: nn.Module, ops: MambaOps, tp: TensorParallel) -> nn.Module:
    """Norm, short conv or attention, residual; norm, `ffn`, residual."""
    hidden, eps = config.hidden_size, config.norm_eps
    if kind == "conv":
        conv = ShortConv(hidden, hidden, config.conv_L_cache, config.conv_bias, ops, tp)
        mixer = MixerPart("conv", conv)
    else:
        mixer = MixerPart("self_attn", _attention(config, ops, tp))
    return DecoderLayer(
        norm=("operator_norm", RMSNorm(hidden, eps=eps)),
        mixers=[mixer],
        ffn_norm=("ffn_norm", RMSNorm(hidden, eps=eps)),
        ffns=[("feed_forward", ffn)],
    )


class Lfm2ForCausalLM(CausalLM):
    """LFM2: short-conv and attention layers, dense SwiGLU feed-forwards."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        kinds = layer_types(config, KINDS)
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[
                _layer(config, kind, self._ffn(config, index, ops, tp), ops, tp)
                for index, kind in enumerate(kinds)
            ],
            norm_eps=config.norm_eps,
        )  # fmt: skip

    @staticmethod
    def _ffn(config: Any, index: int, ops: MambaOps, tp: TensorParallel) -> nn.Module:
        """Layer `index`'s feed-forward: LFM2's dense SwiGLU."""
        return GatedMLP(config.hidden_size, dense_ffn_size(config), False, ops, tp)

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """The checkpoint's SwiGLU, attention and expert-bias names onto this model's (see the
        module docstring)."""
        name = _SWIGLU.sub(lambda m: f"{m[1]}{_SWIGLU_NAMES[m[2]]}.", name)
        for old, new in _RENAMED.items():
            if old in name:
                return name.replace(old, new)
        return name

    @staticmethod
    def expand_weight(name: str, tensor: Any) -> list[tuple[str, Any]]:
        """Fused experts (`gate_up_proj (E, 2F, H)`, `down_proj (E, H, F)`) one by one, under
        the released per-expert names (`experts.E.w1`, `w3`, `w2`)."""
        base, _, kind = name.rpartition(".")
        if not base.endswith(".feed_forward.experts") or kind not in ("gate_up_proj", "down_proj"):
            return [(name, tensor)]
        stacked = tensor[...]  # (E, out, in)
        if kind == "down_proj":
            return [(f"{base}.{e}.w2.weight", w) for e, w in enumerate(stacked)]
        gates, ups = stacked.chunk(2, dim=1)  # (E, F, H) each
        return [
            (f"{base}.{e}.{part}.weight", w)
            for e in range(stacked.shape[0])
            for part, w in (("w1", gates[e]), ("w3", ups[e]))
        ]


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE: LFM2's layers with the MoE after the first `num_dense_layers`."""

    @staticmethod
    def _ffn(config: Any, index: int, ops: MambaOps, tp: TensorParallel) -> nn.Module:
        """Layer `index`'s feed-forward: dense of `intermediate_size` in the first
        `num_dense_layers` layers, else the MoE."""
        if index < config.num_dense_layers:
            return GatedMLP(config.hidden_size, config.intermediate_size, False, ops, tp)
        return _sparse_moe(config, ops, tp)
