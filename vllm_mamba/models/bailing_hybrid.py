"""Ling 3 (`BailingHybridForCausalLM`: `inclusionAI/Ling-3.0-Flash`).

Kimi Linear's skeleton (`models.kimi_linear`) with Ling's layers. `layer_types` (transformers
derives it from `layer_group_size`: the last layer of every group is MLA) picks per layer:

- KDA layers (`layers.ling_delta_attention.LingDeltaAttention`): full-rank forget and output
  gates (`f_proj`, `g_proj`) and, with `kda_safe_gate`, the bounded decay
  `g = kda_lower_bound * sigmoid(exp(A_log) (f_proj(x) + dt_bias))`.
- MLA layers (`layers.mla_attention.MLAAttention`): DeepSeek-V3's latent attention with RoPE
  on the `qk_rope_head_dim` part in GPT-J's interleaved pairing (transformers'
  `apply_rotary_pos_emb_interleave`), the softmax scale of a scaled RoPE's `mscale_all_dim`,
  and a sigmoid gate per head on the output (`g_proj`).
- Feed-forward by `mlp_layer_types`: a dense SwiGLU of `intermediate_size`, or DeepSeek-V3's
  grouped sigmoid MoE (`models.kimi_linear`'s) whose routed and shared experts clip their
  SwiGLU after the activation by the layer's `expert_swiglu_limit_list` /
  `share_expert_swiglu_limit_list` entry (zero or absent: no clip; `layers.clamped_swiglu`).
  transformers 5.24 ignores those lists; 5.25 applies them as here.

Checkpoint names: the releases' `model.word_embeddings`, `attention.*` (`dense` the output
projection), the KDA's `f_proj` / `A_log` / `dt_bias` under the layer, separate `q/k/v_conv1d`,
per-expert `experts.E.{gate,up,down}_proj` and `gate.expert_bias`, map onto transformers'
in-memory names, which load too (`forget_gate.*`, the fused `conv1d`, stacked experts,
`e_score_correction_bias`). The head is untied.

The multi-token prediction layers stored after the decoder (`model.layers.{num_hidden_layers +
i}`, `num_nextn_predict_layers` of them) are skipped unless speculative method `mtp` asks for
them (`models.mtp`). As vLLM's `BailingMoeV3MultiTokenPredictorLayer`, draft `i` runs layer
`i % n`, an MLA and MoE decoder layer between its own projections and norms:

    x = eh_proj(cat([enorm(embed(next_token)), hnorm(hidden)]))
    x = layer(x)                         # input_layernorm, MLA, post_attention_layernorm, MoE
    out = final_layernorm(x);  logits = lm_head(out)       # the target's head (`shared_head`)

with plain RMSNorms of `rms_norm_eps`; their names load as `MultiTokenPredictor`'s
(`checkpoint_weights` renames them to `mtp.*`). A `model.mtp.*` part some exports carry is
skipped.

Ling-3.0-Flash: 42 layers of hidden size 2560 (every 6th MLA), KDA 32 heads of 128 (conv 4),
MLA 32 heads (latent 512, nope 128, rope 64, v 128), 512 experts of 768, top-8 in 8 groups (4
kept) scaled by 2.5, one shared expert, the first 2 layers dense (6144), vocabulary 157184.

Tensor parallelism: as Kimi Linear's (heads split, experts column- then row-parallel, the router
replicated).

Glossary: E experts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, ClassVar

from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.clamped_swiglu import gated_mlp
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.ling_delta_attention import LingDeltaAttention
from vllm_mamba.layers.mla_attention import MLAAttention
from vllm_mamba.layers.rope_scaling import mla_softmax_scale
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.kimi_linear import (
    MLA_NORM_EPS,
    KimiLinearForCausalLM,
    _mlp_layer_types,
    deepseek_moe,
    pre_norm_layer,
)
from vllm_mamba.models.layer_types import layer_types
from vllm_mamba.models.mtp import MTP_PREFIX, SupportsMTP, nextn_weight_name
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="norm")
_RENAMES = (
    (re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"\.attention\."), ".self_attn."),
    (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
    (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
)


def _clip_limits(config: Any, index: int) -> tuple[float, float]:
    """Layer `index`'s SwiGLU clips of the routed and the shared experts
    (`expert_swiglu_limit_list`, `share_expert_swiglu_limit_list`; zero: none). A list the
    config omits, and an MTP layer past the decoder's, clip nothing.

    Raises:
        ValueError: a list does not name every decoder layer.
    """
    layers, limits = config.num_hidden_layers, []
    for name in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        values = list(getattr(config, name, None) or [0.0] * layers)
        if len(values) != layers:
            raise ValueError(f"{name} must name {layers} layers, got {values}")
        limits.append(float(values[index]) if index < layers else 0.0)
    return limits[0], limits[1]


def _kda(config: Any, ops: MambaOps, tp: TensorParallel) -> LingDeltaAttention:
    heads, dim = config.linear_num_heads, config.linear_head_dim
    bound = float(config.kda_lower_bound) if config.kda_safe_gate else 0.0
    return LingDeltaAttention(
        config.hidden_size, heads, heads, dim, dim, config.linear_conv_kernel_dim,
        config.rms_norm_eps, ops, tp, lower_bound=bound,
    )  # fmt: skip


def _mla(config: Any, ops: MambaOps, tp: TensorParallel) -> MLAAttention:
    dn, dr = config.qk_nope_head_dim, config.qk_rope_head_dim
    rotary = RotaryEmbedding.from_config(config, dr, dr, interleaved=True)
    return MLAAttention(
        config.hidden_size, config.num_attention_heads, config.q_lora_rank,
        config.kv_lora_rank, dn, dr, config.v_head_dim, MLA_NORM_EPS, ops, tp,
        bias=bool(config.attention_bias), rotary=rotary,
        scale=mla_softmax_scale(config, dn + dr), head_gate=True,
    )  # fmt: skip


def _layer(
    config: Any, index: int, kind: str, ffn: str, ops: MambaOps, tp: TensorParallel
) -> nn.Module:
    """KDA or MLA; clipped MoE or dense MLP (`kimi_linear.pre_norm_layer`)."""
    mixer = _kda(config, ops, tp) if kind == "linear_attention" else _mla(config, ops, tp)
    if ffn == "sparse":
        mlp: nn.Module = deepseek_moe(config, ops, tp, _clip_limits(config, index))
    else:  # transformers builds the dense MLPs without a layer index: never clipped
        mlp = gated_mlp(config.hidden_size, config.intermediate_size, False, ops, tp)
    return pre_norm_layer(config, mixer, mlp)


class BailingHybridForCausalLM(SupportsMTP, CausalLM):
    """Ling 3: KDA and gated MLA layers, dense MLPs or clipped DeepSeek-V3 MoEs; the MTP
    layers on request (`enable_mtp`)."""

    ties_word_embeddings: ClassVar[bool] = False
    skipped_weights: ClassVar[dict[str, str]] = {
        MTP_PREFIX: "the multi-token prediction layers (Ling's; run by speculative method 'mtp')",
        "model.mtp.": "a multi-token prediction part outside the decoder's layers (not run)",
    }

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu)")
        kinds, ffns = layer_types(config), _mlp_layer_types(config)
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[
                _layer(config, i, k, f, ops, tp) for i, (k, f) in enumerate(zip(kinds, ffns))
            ],
            norm_eps=config.rms_norm_eps,
        )  # fmt: skip

    def mtp_layer(self, index: int, ops: MambaOps, tp: TensorParallel) -> nn.Module:
        """MTP layer `index`: an MLA and MoE decoder layer (vLLM's Bailing V3 MTP layer)."""
        config = self.config  # type: ignore[attr-defined]
        return _layer(config, config.num_hidden_layers + index, "full_attention", "sparse", ops, tp)

    def mtp_head_options(self) -> dict[str, Any]:
        """Plain RMSNorms (`enorm`, `hnorm`, `final_layernorm`)."""
        return {"norm_cls": RMSNorm, "eps": self.config.rms_norm_eps}  # type: ignore[attr-defined]

    def checkpoint_weights(self, weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The MTP layers' tensors (`model.layers.{num_hidden_layers + i}.*`) as `mtp.layers.{i}.*`
        and their projections and norms as `MultiTokenPredictor`'s; their `shared_head.head`
        (the target's head again) dropped."""
        first = self.config.num_hidden_layers  # type: ignore[attr-defined]
        for name, tensor in weights:
            renamed = nextn_weight_name(name, first, "final_layernorm.")
            if renamed is not None:
                yield renamed, tensor

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """The releases' names (and transformers' `forget_gate.*`) onto this model's; per-expert
        `experts.E.*` and stacked experts as Kimi Linear's (the MTP layers' too)."""
        if name.startswith(MTP_PREFIX):
            body = BailingHybridForCausalLM.remap_weight_name("model." + name[len(MTP_PREFIX) :])
            return MTP_PREFIX + body[len("model.") :]
        for pattern, repl in _RENAMES:
            name = pattern.sub(repl, name, count=1)
        return KimiLinearForCausalLM.remap_weight_name(name)

    @staticmethod
    def expand_weight(name: str, tensor: Any) -> list[tuple[str, Any]]:
        """transformers' fused KDA conv and stacked experts one by one (as Kimi Linear's)."""
        return KimiLinearForCausalLM.expand_weight(name, tensor)
