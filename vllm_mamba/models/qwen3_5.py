"""Qwen3.5 / Qwen3.6 (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, and the image-text
`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`).

A hybrid of Gated DeltaNet and gated-attention layers by `layer_types` (`linear_attention` /
`full_attention`; three GDN layers to one attention layer in the releases). Each layer is
pre-norm twice (`input_layernorm`, `post_attention_layernorm`, zero-centred RMSNorms scaled by
`1 + w`, as is the final `norm`) with plain residuals.

- GDN layers (`linear_attn.*`): `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`,
  `conv1d`, `A_log`, `dt_bias`, `norm`, `out_proj` (`layers.gated_deltanet`).
- Attention layers (`self_attn.*`): `q_proj` doubled into queries and a sigmoid output gate,
  zero-centred q/k norms per head, GQA, RoPE on the first `partial_rotary_factor` (0.25) of each
  head. The checkpoints' interleaved M-RoPE (`mrope_section`) rotates each frequency at one of
  three position rows (time, height, width); for text all three rows are the token's position,
  so it is this plain partial RoPE.
- Feed-forward (`mlp.*`): a SwiGLU MLP (dense), or (MoE) a router `gate` (softmax, top-k,
  renormalised), experts `experts.E.{gate,up,down}_proj` and a shared expert `shared_expert`
  scaled by `sigmoid(shared_expert_gate(x))`. Checkpoints store the experts one by one (as
  transformers saves them) or fused, `experts.gate_up_proj (E, 2F, H)` and
  `experts.down_proj (E, H, F)`, which `expand_weight` splits into the per-expert names.

The image-text checkpoints keep the language model under `model.language_model.*` (renamed to
`model.*`), its config under `text_config`, the head at `lm_head` (tied by the top-level
`tie_word_embeddings`); the vision tower (`model.visual.*`, `models.vision.qwen3_vl`) loads as
`visual` when images are served (`models.image_text.SupportsImages`), else is skipped; image
tokens take M-RoPE positions (`layers.rotary_embedding`). The multi-token
prediction head (`mtp.*`, `mtp_num_hidden_layers` in the text config) is skipped unless asked
for (speculative method `mtp`: `enable_mtp`, `vllm_mamba.models.mtp`), when it is built as
one more gated-attention layer with this model's MLP or MoE (fused experts split as above).
Qwen3.5-0.8B: 24 layers of hidden size 1024, attention every 4th (8 query and 2 KV heads of
256), GDN with 16 key and 16 value heads of 128, vocabulary 248320.

Tensor parallelism (`tp`): GDN by key heads and their value heads, attention by heads, the
MLPs (and every expert) column- then row-parallel; the router and the shared-expert gate
replicated; vocabulary-parallel embedding and head.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.gated_deltanet import Qwen3_5GatedDeltaNet
from vllm_mamba.layers.layernorm import ZeroCenteredRMSNorm
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.moe import ExpertList, ExpertRouter, RouterConfig, SparseMoE
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.layers.self_attention import SelfAttention
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.image_text import SupportsImages
from vllm_mamba.models.layer_types import layer_types
from vllm_mamba.models.mtp import SupportsMTP
from vllm_mamba.models.vision.qwen3_vl import Qwen3VisionEncoder, QwenImageProcessor
from vllm_mamba.ops.table import MambaOps

# transformers' M-RoPE sections when the config names none (time, height, width frequencies)
MROPE_SECTION = [11, 11, 10]
NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="norm")
SKIPPED = {
    "model.visual.": "the vision tower (served text-only: language_model_only)",
    "mtp.": "the multi-token prediction head",
}


def _gdn(config: Any, ops: MambaOps, tp: TensorParallel) -> Qwen3_5GatedDeltaNet:
    return Qwen3_5GatedDeltaNet(
        config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
        config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim,
        config.rms_norm_eps, ops, tp,
    )  # fmt: skip


def gated_attention(config: Any, ops: MambaOps, tp: TensorParallel) -> SelfAttention:
    """Gated attention with zero-centred q/k norms per head and partial RoPE."""
    head_dim, eps = config.head_dim, config.rms_norm_eps
    rotary = RotaryEmbedding.from_config(config, head_dim, mrope_section=MROPE_SECTION)
    return SelfAttention(
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
        bias=config.attention_bias, scale=head_dim**-0.5, rotary=rotary, ops=ops,
        output_gate=True, q_norm=ZeroCenteredRMSNorm(head_dim, eps),
        k_norm=ZeroCenteredRMSNorm(head_dim, eps), tp=tp,
    )  # fmt: skip


def sparse_moe(config: Any, ops: MambaOps, tp: TensorParallel) -> SparseMoE:
    """Routed experts (softmax top-k, renormalised unless the config's `norm_topk_prob` is
    false: Qwen3.5-MoE always renormalises) plus the sigmoid-gated shared expert."""
    hidden, num_experts = config.hidden_size, config.num_experts
    renormalize = bool(getattr(config, "norm_topk_prob", True))
    route = RouterConfig(
        "softmax_topk", num_experts, config.num_experts_per_tok, renormalize=renormalize
    )
    experts = ExpertList(
        GatedMLP(hidden, config.moe_intermediate_size, False, ops, tp, reduce=False)
        for _ in range(num_experts)
    )
    shared = GatedMLP(hidden, config.shared_expert_intermediate_size, False, ops, tp)
    return SparseMoE(
        ExpertRouter(hidden, route, ops), experts, tp, shared=shared,
        shared_gate=Linear(hidden, 1, False, ops),
        names=("gate", "experts", "shared_expert", "shared_expert_gate"),
    )  # fmt: skip


def decoder_layer(
    config: Any, mixer: MixerPart, moe: bool, ops: MambaOps, tp: TensorParallel
) -> nn.Module:
    """Norm, `mixer` (GDN or gated attention), residual; norm, MoE or dense MLP, residual
    (shared by Qwen3.5 and Qwen3-Next)."""
    hidden, eps = config.hidden_size, config.rms_norm_eps
    if moe:
        ffn = sparse_moe(config, ops, tp)
    else:
        ffn = GatedMLP(hidden, config.intermediate_size, False, ops, tp)
    return DecoderLayer(
        norm=("input_layernorm", ZeroCenteredRMSNorm(hidden, eps=eps)),
        mixers=[mixer],
        ffn_norm=("post_attention_layernorm", ZeroCenteredRMSNorm(hidden, eps=eps)),
        ffns=[("mlp", ffn)],
    )


def _layer(config: Any, kind: str, ops: MambaOps, tp: TensorParallel) -> nn.Module:
    """Layer of kind `kind`: the Qwen3.5-layout GDN or gated attention; MoE when the config
    has experts."""
    if kind == "linear_attention":
        mixer = MixerPart("linear_attn", _gdn(config, ops, tp))
    else:
        mixer = MixerPart("self_attn", gated_attention(config, ops, tp))
    return decoder_layer(config, mixer, bool(getattr(config, "num_experts", 0)), ops, tp)


class Qwen3_5ForCausalLM(SupportsMTP, CausalLM):
    """Qwen3.5 language model: Gated DeltaNet and gated-attention layers, dense MLPs (or MoE
    when the config has experts); the MTP head on request (`enable_mtp`)."""

    skipped_weights: ClassVar[dict[str, str]] = SKIPPED

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu)")
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[_layer(config, kind, ops, tp) for kind in layer_types(config)],
            norm_eps=config.rms_norm_eps, final_norm_cls=ZeroCenteredRMSNorm,
        )  # fmt: skip

    def mtp_layer(self, index: int, ops: MambaOps, tp: TensorParallel) -> nn.Module:
        """The MTP's decoder layer: gated attention and this model's MLP (MoE with experts)."""
        return _layer(self.config, "full_attention", ops, tp)

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """An image-text checkpoint's `model.language_model.*` onto `model.*`."""
        return name.replace("model.language_model.", "model.", 1)

    @staticmethod
    def expand_weight(name: str, tensor: Any) -> list[tuple[str, Any]]:
        """Fused experts (`gate_up_proj (E, 2F, H)`, `down_proj (E, H, F)`) one by one."""
        base, _, kind = name.rpartition(".")
        if not base.endswith(".mlp.experts") or kind not in ("gate_up_proj", "down_proj"):
            return [(name, tensor)]
        stacked = tensor[...]  # (E, out, in)
        if kind == "down_proj":
            return [(f"{base}.{e}.down_proj.weight", w) for e, w in enumerate(stacked)]
        gates, ups = stacked.chunk(2, dim=1)  # (E, F, H) each
        return [
            (f"{base}.{e}.{part}_proj.weight", w)
            for e in range(stacked.shape[0])
            for part, w in (("gate", gates[e]), ("up", ups[e]))
        ]


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE language model: every layer's feed-forward is the MoE."""


class Qwen3_5ForConditionalGeneration(SupportsImages, Qwen3_5ForCausalLM):
    """The image-text checkpoint: its `text_config`, the head tied by the top-level
    `tie_word_embeddings`; the Qwen3-VL vision tower (`models.vision.qwen3_vl`) as `visual`
    unless served text-only (`language_model_only`)."""

    image_prefix: ClassVar[str] = "model.visual."  # skipped text-only (`SKIPPED`)
    uses_mrope: ClassVar[bool] = True

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        text = copy.copy(config.text_config)
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        super().__init__(text, ops, tp)
        self.vision_config = config.vision_config

    def build_image_encoder(self, ops: MambaOps) -> Qwen3VisionEncoder:
        """The vision tower, from the checkpoint's `vision_config`."""
        return Qwen3VisionEncoder(self.vision_config, ops)

    @classmethod
    def image_processor(
        cls, model_dir: str, hf_config: Any, tokenizer: Any, overrides: dict[str, Any]
    ) -> QwenImageProcessor:
        """The checkpoint's image processor (`preprocessor_config.json`)."""
        return QwenImageProcessor.from_pretrained(model_dir, hf_config, overrides)

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """`model.language_model.*` onto `model.*`, `model.visual.*` onto `visual.*`."""
        if name.startswith("model.visual."):
            return name[len("model.") :]
        return name.replace("model.language_model.", "model.", 1)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    """The Qwen3.5-MoE image-text checkpoint."""
