"""Kimi Linear (`KimiLinearForCausalLM`: `moonshotai/Kimi-Linear-48B-A3B-Instruct` / `-Base`).

Kimi Delta Attention (KDA) and MLA attention layers by `layer_types` (`linear_attention` /
`full_attention`; the checkpoints' `linear_attn_config` lists them 1-indexed and transformers'
config turns them into `layer_types`), each pre-norm twice (`input_layernorm`,
`post_attention_layernorm`, plain RMSNorms) with plain residuals:

- KDA layers (`self_attn.*`, `layers.kimi_delta_attention.KimiDeltaAttention`): the Gated
  DeltaNet with a per-key-channel decay from a low-rank forget gate and a sigmoid-gated
  output norm.
- MLA layers (`self_attn.*`, `layers.mla_attention.MLAAttention`): DeepSeek-V3's multi-head
  latent attention without rotary embedding (the shared `k_rot` part passes through as is);
  the paged cache holds each token's latent `[c | k_rot]` (`kv_lora_rank + qk_rope_head_dim`
  values), not per-head keys and values.
- Feed-forward (`mlp.*`, saved as `block_sparse_moe.*`): by `mlp_layer_types` (transformers
  derives it from `first_k_dense_replace`), a dense SwiGLU MLP of `intermediate_size`
  (`dense`) or DeepSeek-V3's MoE (`sparse`): sigmoid router `gate` with
  `e_score_correction_bias` used for the choice only, grouped top-k (`n_group`,
  `topk_group`), weights renormalised (`norm_topk_prob`) and scaled by
  `routed_scaling_factor`; experts `experts.E.{w1,w2,w3}` (gate, down, up) of
  `moe_intermediate_size`; `shared_experts` of `moe_intermediate_size * n_shared_experts`.

Checkpoint names beside those: transformers' own in-memory names load too (`forget_gate.*`
under the KDA layer, the fused `conv1d.weight`, `mlp.experts.gate_up_proj` /
`down_proj`), as `remap_weight_name` / `expand_weight` map them. The head is untied.
Kimi-Linear-48B-A3B: 27 layers of hidden size 2304 (every 4th MLA, from the 4th), KDA 32 heads
of 128, MLA 32 heads (`kv_lora_rank` 512, nope 128, rope 64, v 128), 256 experts of 1024,
top-8, a shared expert, vocabulary 163840.

Tensor parallelism (`tp`): KDA and MLA by heads, every expert and MLP column- then
row-parallel, the router replicated; vocabulary-parallel embedding and head.

Glossary: E experts, F expert size.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.clamped_swiglu import gated_mlp
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.kimi_delta_attention import KimiDeltaAttention
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mla_attention import MLAAttention
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.moe import ExpertList, ExpertRouter, RouterConfig, SparseMoE
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.layer_types import layer_types
from vllm_mamba.models.qwen3_5 import Qwen3_5ForCausalLM
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="norm")
_EXPERT_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# The MLA layers' `q_a_layernorm` / `kv_a_layernorm` are built without the config's epsilon, so
# they keep the RMSNorm default (transformers' KimiLinearRMSNorm and the released modeling code).
MLA_NORM_EPS = 1e-6
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(w[123])\.")


def _kda(config: Any, ops: MambaOps, tp: TensorParallel) -> KimiDeltaAttention:
    heads, dim = config.linear_num_heads, config.linear_head_dim
    return KimiDeltaAttention(
        config.hidden_size, heads, heads, dim, dim, config.linear_conv_kernel_dim,
        config.rms_norm_eps, ops, tp,
    )  # fmt: skip


def _mla(config: Any, ops: MambaOps, tp: TensorParallel) -> MLAAttention:
    return MLAAttention(
        config.hidden_size, config.num_attention_heads, config.q_lora_rank,
        config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
        config.v_head_dim, MLA_NORM_EPS, ops, tp, bias=bool(config.attention_bias),
    )  # fmt: skip


def deepseek_moe(
    config: Any, ops: MambaOps, tp: TensorParallel, limits: tuple[float, float] = (0.0, 0.0),
    before_act: bool = False,
) -> SparseMoE:  # fmt: skip
    """DeepSeek-V3's routed experts plus the shared ones; `limits` the routed and the shared
    experts' SwiGLU clips (Ling 3's after the activation, GLM-5-Next's `before_act`; zero:
    none, `layers.clamped_swiglu`)."""
    hidden, num_experts = config.hidden_size, config.num_local_experts
    route = RouterConfig(
        "sigmoid_grouped", num_experts, config.num_experts_per_tok,
        renormalize=bool(config.norm_topk_prob), n_group=config.n_group,
        topk_group=config.topk_group, scaling=float(config.routed_scaling_factor),
        score_bias=True,
    )  # fmt: skip
    size = config.moe_intermediate_size
    experts = ExpertList(
        gated_mlp(
            hidden, size, False, ops, tp, reduce=False, limit=limits[0], before_act=before_act
        )
        for _ in range(num_experts)
    )
    shared = None
    if config.n_shared_experts:
        shared = gated_mlp(
            hidden, size * config.n_shared_experts, False, ops, tp, limit=limits[1],
            before_act=before_act,
        )  # fmt: skip
    return SparseMoE(
        ExpertRouter(hidden, route, ops), experts, tp, shared=shared,
        names=("gate", "experts", "shared_experts"),
    )  # fmt: skip


def pre_norm_layer(config: Any, mixer: nn.Module, mlp: nn.Module) -> nn.Module:
    """Norm, `mixer` (`self_attn`), residual; norm, `mlp`, residual (plain RMSNorms,
    `input_layernorm` / `post_attention_layernorm`): Kimi Linear's and Ling 3's layer."""
    hidden, eps = config.hidden_size, config.rms_norm_eps
    return DecoderLayer(
        norm=("input_layernorm", RMSNorm(hidden, eps=eps)),
        mixers=[MixerPart("self_attn", mixer)],
        ffn_norm=("post_attention_layernorm", RMSNorm(hidden, eps=eps)),
        ffns=[("mlp", mlp)],
    )


def _layer(config: Any, kind: str, ffn: str, ops: MambaOps, tp: TensorParallel) -> nn.Module:
    """KDA or MLA; MoE or dense MLP (`pre_norm_layer`)."""
    mixer = _kda(config, ops, tp) if kind == "linear_attention" else _mla(config, ops, tp)
    if ffn == "sparse":
        mlp: nn.Module = deepseek_moe(config, ops, tp)
    else:
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, False, ops, tp)
    return pre_norm_layer(config, mixer, mlp)


def _mlp_layer_types(config: Any) -> list[str]:
    """`dense` or `sparse` per layer.

    Raises:
        ValueError: the list does not name `num_hidden_layers` layers of those kinds.
    """
    kinds = list(config.mlp_layer_types or [])
    if len(kinds) != config.num_hidden_layers or not set(kinds) <= {"dense", "sparse"}:
        raise ValueError(
            f"mlp_layer_types must name {config.num_hidden_layers} layers, each 'dense' or "
            f"'sparse'; got {kinds}"
        )
    return kinds


def _check_release_options(config: Any) -> None:
    """Refuses the options of the checkpoints' own config that transformers' model ignores and
    this one does not implement (the releases set them as checked here).

    Raises:
        ValueError: naming the option.
    """
    activation = getattr(config, "moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise ValueError(f"moe_router_activation_func {activation!r} is not supported (sigmoid)")
    if not getattr(config, "mla_use_nope", True):
        raise ValueError("mla_use_nope=False (rotary MLA) is not supported: Kimi Linear is NoPE")
    if getattr(config, "num_nextn_predict_layers", 0):
        raise ValueError("num_nextn_predict_layers > 0 (MTP layers) is not supported")


class KimiLinearForCausalLM(CausalLM):
    """Kimi Linear language model: KDA and MLA layers, dense MLPs or DeepSeek-V3 MoEs."""

    ties_word_embeddings: ClassVar[bool] = False

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu)")
        _check_release_options(config)
        kinds, ffns = layer_types(config), _mlp_layer_types(config)
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[_layer(config, k, f, ops, tp) for k, f in zip(kinds, ffns)],
            norm_eps=config.rms_norm_eps,
        )  # fmt: skip

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """The checkpoints' `block_sparse_moe` and experts' `w1/w2/w3`, and transformers'
        `forget_gate.*`, onto this model's names."""
        name = name.replace(".block_sparse_moe.", ".mlp.", 1)
        name = name.replace(".self_attn.forget_gate.", ".self_attn.", 1)
        return _EXPERT.sub(lambda m: f".mlp.experts.{m[1]}.{_EXPERT_PARTS[m[2]]}.", name)

    @staticmethod
    def expand_weight(name: str, tensor: Any) -> list[tuple[str, Any]]:
        """transformers' fused tensors one by one: the KDA conv `conv1d.weight (3 C, 1, K)`
        as `q_conv1d`, `k_conv1d`, `v_conv1d`, and stacked experts as Qwen3.5's."""
        if name.endswith(".self_attn.conv1d.weight"):
            base = name[: -len("conv1d.weight")]
            parts = tensor[...].chunk(3, dim=0)  # KDA's q, k and v have the same width
            return [(f"{base}{p}_conv1d.weight", w) for p, w in zip("qkv", parts)]
        return Qwen3_5ForCausalLM.expand_weight(name, tensor)
