"""GLM-5-Next (`Glm5NextForConditionalGeneration`: `zai-org/GLM-5.3-Flash`), served text-only.

KDA and DSA layers by `layer_types` (`linear_attention` / `indexed_attention`), each two
pre-norm stages (`input_layernorm`, `post_attention_layernorm`) inside manifold-constrained
hyper-connections over `hc_mult` residual streams (`attn_hc`, `ffn_hc`:
`layers.hyper_connection`); the embeddings enter every stream and the streams' mean is normed
for the head:

- KDA layers (`self_attn.*`): Kimi's KDA (low-rank forget and output gates, three convs) with
  `A_log (Hv,)` and, with `linear_lower_bound`, the bounded safe gate
  `g = lower_bound * sigmoid(exp(A_log) (f + dt_bias))`.
- DSA layers (`self_attn.*`, `layers.indexed_mla_attention`): MLA without rotary embedding
  (NoPE: `qk_rope_head_dim` 0) whose queries attend only to the tokens the indexer selects:
  `index_topk` tokens in pools of `index_kpool` plus the query's incomplete pool
  (`layers.pool_indexer`); by `indexer_types` a layer runs its own indexer (`full`) or reuses
  the selection of the full DSA layer just before it (`shared`).
- Feed-forward by `mlp_layer_types`: a dense SwiGLU of `intermediate_size` or DeepSeek-V3's
  grouped sigmoid MoE (`models.kimi_linear.deepseek_moe`), every SwiGLU clipped before its
  activation at `swiglu_limit` (gate at most the limit, up within +-limit).

Checkpoint names: the image-text release's `model.language_model.*` (or a text-only one's
`model.*`), the KDA's `f_a_proj` / `f_b_proj` / `dt_bias` / `A_log` under `self_attn`, separate
`q/k/v_conv1d`, `hc_attn_fn` / `hc_attn_base` / `hc_attn_scale` (and `hc_ffn_*`), per-expert
`experts.E.{gate,up,down}_proj`; transformers' in-memory names load too. The vision tower
(`model.visual.*`) is skipped.

The multi-token prediction layer stored after the decoder (`layers.{num_hidden_layers + i}`,
`num_nextn_predict_layers` of them, one when the config names none) is skipped unless
speculative method `mtp` asks for it (`models.mtp`). As vLLM's `Glm5NextMTP` (the GLM-4.5 MTP
layer's arithmetic), the layer has no hyper-connections and reads the target's collapsed state:

    e = enorm(embed(t + 1)), zeroed at position 0      x = eh_proj(cat([e, hnorm(h_t)]))
    x = x + attn(input_layernorm(x))                   a DSA layer with its own (full) indexer
    x = x + moe(post_attention_layernorm(x))           the last decoder layer's feed-forward kind
    out = shared_head.norm(x)                           fed back; logits: the target's head

`h_t` is the target's output (the streams' mean after the final norm). `shared_head.head`, the
head again, is not loaded; `index_share_for_mtp_iteration` (reusing a draft's selection in the
next) is not done: every draft runs its indexer.

GLM-5.3-Flash: 45 layers of hidden size 4096 (every 4th DSA), KDA 64 heads of 128, MLA 64 heads
(q rank 1536, latent 512, nope 256, v 256), indexer 32 heads of 128 over pools of 16, top-2048,
4 streams, 288 experts of 2048 (top-8, scaled by 2.5), one shared, the first 3 layers dense.

Tensor parallelism: KDA and MLA heads split, experts column- then row-parallel; the indexer,
the hyper-connections and the router replicated.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, ClassVar

from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.clamped_swiglu import gated_mlp
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.hyper_connection import HyperConnection
from vllm_mamba.layers.indexed_mla_attention import IndexedMLAAttention
from vllm_mamba.layers.kimi_delta_attention import KimiDeltaAttention
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.pool_indexer import PoolIndexer
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.kimi_linear import KimiLinearForCausalLM, _mlp_layer_types, deepseek_moe
from vllm_mamba.models.mtp import MTP_PREFIX, SupportsMTP, nextn_weight_name
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="norm")
_HC = re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$")


class GlmDeltaAttention(KimiDeltaAttention):
    """Kimi's KDA with `A_log (Hv,)` and GLM's bounded safe gate (`lower_bound` < 0)."""

    A_LOG_SHAPE = (-1,)

    def __init__(self, *args: object, lower_bound: float, **kwargs: object) -> None:
        """Args: `KimiDeltaAttention`'s; `lower_bound` the safe gate's bound (negative), or 0
        for Kimi's softplus gate (`linear_lower_bound` None).

        Raises:
            ValueError: `lower_bound` is positive.
        """
        if lower_bound > 0:
            raise ValueError(f"linear_lower_bound must be negative, got {lower_bound}")
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lower_bound = float(lower_bound)


def _layer_kinds(config: Any) -> list[tuple[str, str]]:
    """`(layer type, indexer type)` per layer.

    Raises:
        ValueError: a list does not name every layer with known kinds, or a shared DSA layer
            does not follow a full one.
    """
    n = config.num_hidden_layers
    kinds, index = list(config.layer_types or []), list(config.indexer_types or [])
    if len(kinds) != n or not set(kinds) <= {"linear_attention", "indexed_attention"}:
        raise ValueError(f"layer_types must name {n} layers, each 'linear_attention' or "
                         f"'indexed_attention'; got {kinds}")  # fmt: skip
    if len(index) != n or not set(index) <= {"full", "shared"}:
        raise ValueError(
            f"indexer_types must name {n} layers, each 'full' or 'shared'; got {index}"
        )
    for i, (kind, mode) in enumerate(zip(kinds, index)):
        if kind == "indexed_attention" and mode == "shared":
            if i == 0 or kinds[i - 1] != "indexed_attention" or index[i - 1] != "full":
                raise ValueError(
                    f"indexer_types[{i}] is 'shared' but layer {i - 1} is not a full DSA layer"
                )
    return list(zip(kinds, index))


def _check_options(config: Any) -> None:
    """Refuses what transformers' model refuses, and what this one does not implement.

    Raises:
        ValueError: naming the option.
    """
    if config.hidden_act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu)")
    if config.qk_rope_head_dim:
        raise ValueError(f"qk_rope_head_dim must be 0 (DSA is NoPE), got {config.qk_rope_head_dim}")
    if config.q_lora_rank is None:
        raise ValueError("q_lora_rank is required: the DSA indexer reads the low-rank query")
    if not getattr(config, "index_kpool_always_select_tail", True):
        raise ValueError("index_kpool_always_select_tail=False is not supported")


def _kda(config: Any, ops: MambaOps, tp: TensorParallel) -> GlmDeltaAttention:
    heads, dim = config.linear_num_heads, config.linear_head_dim
    bound = config.linear_lower_bound
    return GlmDeltaAttention(
        config.hidden_size, heads, heads, dim, dim, config.linear_conv_kernel_dim,
        config.rms_norm_eps, ops, tp, lower_bound=0.0 if bound is None else float(bound),
    )  # fmt: skip


def _dsa(config: Any, full: bool, ops: MambaOps, tp: TensorParallel) -> IndexedMLAAttention:
    indexer = None
    if full:
        indexer = PoolIndexer(
            config.hidden_size, config.q_lora_rank, config.index_n_heads, config.index_head_dim,
            config.index_kpool, config.index_topk, ops,
        )  # fmt: skip
    return IndexedMLAAttention(
        config.hidden_size, config.num_attention_heads, config.q_lora_rank,
        config.kv_lora_rank, config.qk_nope_head_dim, 0, config.v_head_dim,
        config.rms_norm_eps, ops, tp, bias=bool(config.attention_bias), indexer=indexer,
    )  # fmt: skip


def _hc(config: Any, ops: MambaOps) -> HyperConnection:
    return HyperConnection(
        config.hidden_size, config.hc_mult, config.hc_sinkhorn_iters, config.hc_eps,
        config.rms_norm_eps, ops,
    )  # fmt: skip


def _layer(
    config: Any,
    kind: tuple[str, str],
    ffn: str,
    ops: MambaOps,
    tp: TensorParallel,
    hyper: bool = True,
) -> DecoderLayer:
    """KDA or DSA; clipped MoE or dense MLP; both stages inside hyper-connections (`hyper`)."""
    if kind[0] == "linear_attention":
        mixer: nn.Module = _kda(config, ops, tp)
    else:
        mixer = _dsa(config, kind[1] == "full", ops, tp)
    limit = float(config.swiglu_limit or 0.0)
    if ffn == "sparse":
        mlp: nn.Module = deepseek_moe(config, ops, tp, (limit, limit), before_act=True)
    else:
        mlp = gated_mlp(config.hidden_size, config.intermediate_size, False, ops, tp,
                        limit=limit, before_act=True)  # fmt: skip
    hidden, eps = config.hidden_size, config.rms_norm_eps
    return DecoderLayer(
        norm=("input_layernorm", RMSNorm(hidden, eps=eps)),
        mixers=[MixerPart("self_attn", mixer)],
        ffn_norm=("post_attention_layernorm", RMSNorm(hidden, eps=eps)),
        ffns=[("mlp", mlp)],
        hyper=(("attn_hc", _hc(config, ops)), ("ffn_hc", _hc(config, ops))) if hyper else None,
    )


class Glm5NextForConditionalGeneration(SupportsMTP, CausalLM):
    """GLM-5-Next's language model (see the module docstring); images are not served; the MTP
    layers on request (`enable_mtp`)."""

    ties_word_embeddings: ClassVar[bool] = False
    mtp_default_layers: ClassVar[int | None] = 1
    skipped_weights: ClassVar[dict[str, str]] = {
        "model.visual.": "the vision tower (served text-only)",
        MTP_PREFIX: "the multi-token prediction layer (GLM's; run by speculative method 'mtp')",
    }

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        text = getattr(config, "text_config", None) or config
        _check_options(text)
        kinds, ffns = _layer_kinds(text), _mlp_layer_types(text)
        super().__init__(
            text, ops, tp, names=NAMES,
            layers=[_layer(text, k, f, ops, tp) for k, f in zip(kinds, ffns)],
            norm_eps=text.rms_norm_eps, streams=text.hc_mult,
        )  # fmt: skip
        for i, (kind, mode) in enumerate(kinds):
            if kind == "indexed_attention" and mode == "shared":
                self.layers[i].self_attn.share_from(self.layers[i - 1].self_attn)

    def mtp_head_layers(self, count: int, ops: MambaOps, tp: TensorParallel) -> list[nn.Module]:
        """The one MTP layer (its norms and projection are the head's own).

        Raises:
            ValueError: the config names more than one (`num_nextn_predict_layers`).
        """
        if count != 1:
            raise ValueError(f"num_nextn_predict_layers {count}: one MTP layer is supported")
        return [self.mtp_layer(0, ops, tp)]

    def mtp_layer(self, index: int, ops: MambaOps, tp: TensorParallel) -> nn.Module:
        """MTP layer `index`: a DSA layer with its own indexer and the last decoder layer's
        feed-forward kind, without hyper-connections (vLLM's GLM-5-Next MTP layer)."""
        config = self.config  # type: ignore[attr-defined]
        ffn = _mlp_layer_types(config)[-1]
        return _layer(config, ("indexed_attention", "full"), ffn, ops, tp, hyper=False)

    def mtp_head_options(self) -> dict[str, Any]:
        """Plain RMSNorms (`enorm`, `hnorm`, `shared_head.norm`); the embedding zeroed at
        position 0."""
        return {"norm_cls": RMSNorm, "eps": self.config.rms_norm_eps, "mask_first": True}  # type: ignore[attr-defined]

    def checkpoint_weights(self, weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The decoder's names without `language_model.`; the layers past the decoder (the MTP
        layers) as `mtp.layers.{i}.*` and their projections and norms as
        `MultiTokenPredictor`'s; their `shared_head.head` (the target's head again) dropped."""
        first = self.config.num_hidden_layers  # type: ignore[attr-defined]
        for name, tensor in weights:
            name = name.replace("model.language_model.", "model.", 1)
            renamed = nextn_weight_name(name, first, "shared_head.norm.")
            if renamed is not None:
                yield renamed, tensor

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """`hc_attn_fn` ... onto `attn_hc.fn` ...; the KDA's and the experts' names as Kimi
        Linear's (transformers' `forget_gate.*` under the layer); the MTP layers' alike."""
        if name.startswith(MTP_PREFIX):
            rest = "model." + name[len(MTP_PREFIX) :]
            body = Glm5NextForConditionalGeneration.remap_weight_name(rest)
            return MTP_PREFIX + body[len("model.") :]
        name = _HC.sub(lambda m: f".{m[1]}_hc.{m[2]}", name)
        return KimiLinearForCausalLM.remap_weight_name(name)

    @staticmethod
    def expand_weight(name: str, tensor: Any) -> list[tuple[str, Any]]:
        """transformers' fused KDA conv and stacked experts one by one (as Kimi Linear's)."""
        return KimiLinearForCausalLM.expand_weight(name, tensor)
