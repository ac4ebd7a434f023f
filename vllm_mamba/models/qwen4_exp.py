"""Qwen4-Exp (`Qwen4ExpForCausalLM`; the image-text `Qwen4ExpForConditionalGeneration`,
`Qwen/Qwen3.8-Flash-Next`, served text-only).

Gated DeltaNet and indexed-attention layers by `layer_types` (`linear_attention` /
`indexed_attention`; a checkpoint's `full_attention` means indexed), every one inside gated
hyper-connections over `hc_count` residual streams (`attn_hyper_connection`,
`mlp_hyper_connection`, which also norm the stage's input: the layers have no norms of their
own), and the model's `hyper_connection_mixer` merging the streams for the head (no final norm):

- GDN layers (`linear_attn.*`): Qwen3.5's (`layers.gated_deltanet.Qwen3_5GatedDeltaNet`).
- Indexed attention (`self_attn.*`, `layers.qsa_attention`): Qwen3.5's gated attention with
  zero-centred q/k norms and partial RoPE, over the tokens its QSA indexer selects
  (`indexer_budget` tokens of complete blocks of `indexer_compress_ratio`, plus the query's
  incomplete block).
- Feed-forward (`mlp.*`): Qwen3.5-MoE's softmax top-k experts with the sigmoid-gated shared
  expert.
- Per-layer n-gram embeddings on the layers `ple_layer_ids` names (1-indexed, `ple.*`,
  `layers.ngram_embedding`): hashed n-gram tables read by the token ids, gated per stream and
  passed through a dilated depthwise conv, added to the streams before the layer; the last
  `ngram_size - 1` ids and the conv's history are per-sequence state.

Checkpoint names: `model.layers.*` (`model.language_model.*` in the image-text release),
per-expert `experts.E.*` or transformers' stacked experts, the n-gram tables in
`split_ngram_parts` shards (`ngram_embedding.shard_{i}.weight`, concatenated here) and the hash
constants transformers saves (derived here, skipped). The vision tower (`model.visual.*`) is
skipped.

The multi-token prediction head (`mtp.*`, `mtp_num_hidden_layers` layers, one when the config
names none) is skipped unless speculative method `mtp` asks for it (`models.mtp`). As SGLang's
`Qwen4ExpForCausalLMMTP` it is a one-layer Qwen4-Exp over the target's streams
(`models.mtp.StreamsMultiTokenPredictor`): `pre_fc_norm_embedding`, `fc_embedding`,
`pre_fc_norm_hidden` (over all streams), `fc_hidden` (per stream), `layers.0` (an indexed
attention layer with the MoE inside its two hyper-connections, no n-gram embeddings) and its own
`hyper_connection_mixer` before the target's head.

Tensor parallelism: the GDN and attention heads and the experts split as Qwen3.5's; the
indexer, the hyper-connections and the n-gram layers replicated.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.hyper_connection import GatedResidual
from vllm_mamba.layers.layernorm import ZeroCenteredRMSNorm
from vllm_mamba.layers.ngram_embedding import CHECKPOINT_BUFFERS, PerLayerEmbedding
from vllm_mamba.layers.qsa_attention import IndexedSelfAttention, QSAIndexer
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.mtp import MTP_PREFIX, StreamsMultiTokenPredictor, SupportsMTP
from vllm_mamba.models.qwen3_5 import MROPE_SECTION, Qwen3_5ForCausalLM, _gdn, sparse_moe
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="norm")
_SHARD = re.compile(r"^(.*\.ngram_embedding)\.shard_(\d+)\.weight$")


def _check_options(config: Any) -> None:
    """Refuses what this model does not implement.

    Raises:
        ValueError: naming the option.
    """
    if config.hidden_act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu)")
    gate = config.output_gate_type or config.hidden_act
    if gate not in ("silu", "swish"):
        raise ValueError(f"output_gate_type {gate!r} is not supported (silu)")
    kinds = set(config.layer_types)
    if not kinds <= {"linear_attention", "indexed_attention"}:
        raise ValueError(f"layer_types must be 'linear_attention' or 'indexed_attention': {kinds}")
    if "indexed_attention" in kinds:
        fields = ("indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
        missing = [f for f in fields if not getattr(config, f, None)]
        if missing:
            raise ValueError(f"indexed attention needs {', '.join(missing)}")
        if (config.indexer_kv_heads or 1) != 1:
            raise ValueError(f"indexer_kv_heads must be 1, got {config.indexer_kv_heads}")


def _attention(config: Any, ops: MambaOps, tp: TensorParallel) -> IndexedSelfAttention:
    head_dim, eps = config.head_dim, config.rms_norm_eps
    rotary = RotaryEmbedding.from_config(config, head_dim, mrope_section=MROPE_SECTION)
    index_dim = config.indexer_head_dim
    indexer = QSAIndexer(
        config.hidden_size, config.indexer_n_heads, index_dim, config.indexer_compress_ratio,
        config.indexer_budget, eps,
        RotaryEmbedding.from_config(
            config, index_dim, rot_dim=rotary.rot_dim, mrope_section=MROPE_SECTION
        ),
        ops,
    )  # fmt: skip
    return IndexedSelfAttention(
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
        bias=config.attention_bias, scale=head_dim**-0.5, rotary=rotary, ops=ops,
        output_gate=True, q_norm=ZeroCenteredRMSNorm(head_dim, eps),
        k_norm=ZeroCenteredRMSNorm(head_dim, eps), tp=tp, indexer=indexer,
    )  # fmt: skip


def _ple(config: Any, ple_index: int, ops: MambaOps) -> PerLayerEmbedding:
    eos = config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is None:
        raise ValueError("per-layer n-gram embeddings need eos_token_id (it cuts the n-grams)")
    return PerLayerEmbedding(
        config.hidden_size, config.hc_count, config.ple_embed_dim, config.vocab_size,
        config.ngram_size, config.heads_per_ngram, config.ngram_vocab_size_base,
        config.make_ngram_vocab_size_divisible_by, config.seed, ple_index,
        config.ple_conv_kernel_size, int(eos), config.rms_norm_eps, ops,
    )  # fmt: skip


def _connection(config: Any, ops: MambaOps, inject: bool = True) -> GatedResidual:
    return GatedResidual(
        config.hidden_size, config.hc_count, config.hc_lowrank, config.rms_norm_eps, ops, inject
    )


def _layer(
    config: Any, index: int, ops: MambaOps, tp: TensorParallel, kind: str | None = None
) -> DecoderLayer:
    """Layer `index` of `layer_types` (or of `kind`, with no n-gram embeddings: the MTP's)."""
    ple_ids = list(config.ple_layer_ids or []) if kind is None else []
    kind = config.layer_types[index] if kind is None else kind
    if kind == "linear_attention":
        mixer = MixerPart("linear_attn", _gdn(config, ops, tp))
    else:
        mixer = MixerPart("self_attn", _attention(config, ops, tp))
    ple = None
    if index + 1 in ple_ids:
        ple = ("ple", _ple(config, ple_ids.index(index + 1), ops))
    return DecoderLayer(
        mixers=[mixer],
        ffns=[("mlp", sparse_moe(config, ops, tp))],
        hyper=(("attn_hyper_connection", _connection(config, ops)),
               ("mlp_hyper_connection", _connection(config, ops))),
        injection=ple,
    )  # fmt: skip


class _NoNorm(nn.Identity):
    """The absent final norm (the streams' merge norms them)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()


class Qwen4ExpForCausalLM(SupportsMTP, CausalLM):
    """Qwen4-Exp's language model (see the module docstring); the MTP head on request
    (`enable_mtp`)."""

    mtp_default_layers: ClassVar[int | None] = 1
    mtp_head_cls = StreamsMultiTokenPredictor
    skipped_weights: ClassVar[dict[str, str]] = {
        "model.visual.": "the vision tower (served text-only)",
        MTP_PREFIX: "the multi-token prediction head (run by speculative method 'mtp')",
    }

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        _check_options(config)
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[_layer(config, i, ops, tp) for i in range(config.num_hidden_layers)],
            norm_eps=config.rms_norm_eps, final_norm_cls=_NoNorm, streams=config.hc_count,
        )  # fmt: skip
        self.stack.add_module("hyper_connection_mixer", _connection(config, ops, inject=False))

    def merge_streams(self, streams: torch.Tensor) -> torch.Tensor:
        """The streams `(T, N, H)` merged by the `hyper_connection_mixer` -> `(T, H)`."""
        return self.stack.hyper_connection_mixer.merge(streams)

    def mtp_layer(self, index: int, ops: MambaOps, tp: TensorParallel) -> nn.Module:
        """The MTP's layer: indexed attention and the MoE, no n-gram embeddings."""
        return _layer(self.config, index, ops, tp, kind="indexed_attention")

    def checkpoint_weights(self, weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The n-gram tables' shards concatenated (once all are read); transformers' saved hash
        constants dropped."""
        parts = int(getattr(self.config, "split_ngram_parts", 1) or 1)
        shards: dict[str, dict[int, Any]] = {}
        for name, tensor in weights:
            if name.endswith(CHECKPOINT_BUFFERS):
                continue
            match = _SHARD.match(name)
            if match is None:
                yield name, tensor
                continue
            table = shards.setdefault(match[1], {})
            table[int(match[2])] = tensor[...]
            if len(table) == parts:
                yield f"{match[1]}.weight", torch.cat([table[i] for i in range(parts)])
                del shards[match[1]]
        if shards:
            base, table = next(iter(shards.items()))
            raise ValueError(
                f"{base}: {len(table)} of its {parts} shards (split_ngram_parts) are stored"
            )

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """An image-text checkpoint's `model.language_model.*` onto `model.*`."""
        return Qwen3_5ForCausalLM.remap_weight_name(name)

    @staticmethod
    def expand_weight(name: str, tensor: Any) -> list[tuple[str, Any]]:
        """transformers' stacked experts one by one (as Qwen3.5's)."""
        return Qwen3_5ForCausalLM.expand_weight(name, tensor)


class Qwen4ExpForConditionalGeneration(Qwen4ExpForCausalLM):
    """The image-text release served text-only: its `text_config`."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config.text_config, ops, tp)
