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
  `input_linear.weight[e] @ x`, then `output_linear.weight[e]`.
- The Mamba2 layers are the SSD mixer (`mamba.*`), state in `mamba_cache`.

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
import torch.nn.functional as F
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.distributed.communication import all_reduce
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mamba2_mixer import Mamba2Mixer
from vllm_mamba.layers.parallel_linear import (
    column_linear,
    even_ranges,
    row_linear,
    shard_param,
    vocab_embedding,
)
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

MAMBA_TYPES = ("mamba", "linear_attention")
ATTENTION_TYPES = ("attention", "full_attention")


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


class SharedMLP(nn.Module):
    """`output_linear(silu(g) * u)` with `g, u` the halves of `input_linear(x)`."""

    def __init__(
        self, hidden_size: int, ffn_size: int, ops: MambaOps, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.input_linear = column_linear(hidden_size, [ffn_size, ffn_size], False, ops, tp)
        self.output_linear = row_linear(ffn_size, hidden_size, False, ops, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`."""
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


class GraniteRouter(nn.Module):
    """Expert logits `layer(x)`; the checkpoint's `router.layer.weight (E, H)`."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden_size, num_experts, bias=False)


class GraniteMoE(nn.Module):
    """Top-k of `num_local_experts` gated MLPs per token, softmax-weighted over the chosen k.

    The experts' weights are stacked: `input_linear.weight (E, 2F, H)`, `output_linear.weight
    (E, H, F)`.
    """

    def __init__(self, config: Any, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        num_experts, hidden, ffn = (
            config.num_local_experts,
            config.hidden_size,
            config.intermediate_size,
        )
        self.top_k = config.num_experts_per_tok
        self.tp = tp
        self.router = GraniteRouter(hidden, num_experts)
        local = tp.split(ffn, "intermediate_size")  # this rank's expert width
        self.input_linear = _StackedWeight(num_experts, 2 * local, hidden)
        self.output_linear = _StackedWeight(num_experts, hidden, local)
        if tp.size > 1:
            halves = even_ranges([ffn, ffn], tp, "intermediate_size")
            shard_param(self.input_linear, "weight", 1, halves, 2 * ffn)
            shard_param(self.output_linear, "weight", 2, [tp.range(ffn, "ffn")], ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`: each token's chosen experts, summed by weight."""
        logits = F.linear(x, self.router.layer.weight).float()  # (T, E)
        top_logits, chosen = logits.topk(self.top_k, dim=-1)  # (T, k) each
        weights = top_logits.softmax(dim=-1).to(x.dtype)  # (T, k)
        out = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():  # ascending, as transformers adds them
            token_idx, k_pos = torch.where(chosen == expert)  # (M,), (M,): tokens are distinct
            gate, up = F.linear(x[token_idx], self.input_linear.weight[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.output_linear.weight[expert])  # (M, H)
            out[token_idx] += y * weights[token_idx, k_pos, None]
        return all_reduce(out, self.tp)


class _StackedWeight(nn.Module):
    """One `weight (E, out, in)` parameter: the experts' matrices stacked."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))


class GraniteLayer(nn.Module):
    """Norm, mixer (`mamba` or `self_attn`), scaled residual; norm, MoE + shared MLP (or the
    shared MLP alone), scaled residual."""

    def __init__(self, config: Any, index: int, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.is_attention = layer_types(config)[index] in ATTENTION_TYPES
        if self.is_attention:
            head_dim = GraniteMoeHybridForCausalLM.head_dim(config)
            rotary = None
            if getattr(config, "position_embedding_type", None) == "rope":
                base, _ = rope_settings(config, head_dim)  # transformers rotates whole heads
                rotary = RotaryEmbedding(head_dim, head_dim, config.max_position_embeddings, base)
            self.self_attn = SelfAttention(
                config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                head_dim, bias=config.attention_bias, scale=config.attention_multiplier,
                rotary=rotary, ops=ops, tp=tp,
            )  # fmt: skip
        else:
            args = GraniteMoeHybridForCausalLM.mamba2_args(config)
            self.mamba = Mamba2Mixer(**args, ops=ops, tp=tp)
        self.block_sparse_moe = GraniteMoE(config, tp) if config.num_local_experts > 0 else None
        self.shared_mlp = SharedMLP(config.hidden_size, config.shared_intermediate_size, ops, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    def forward(
        self, hidden: torch.Tensor, state: LayerState | None, meta: PagedMetadata
    ) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`; `state` is the Mamba2 layer's cache view."""
        normed = self.input_layernorm(hidden)
        if self.is_attention:
            mixed = self.self_attn(normed, meta)
        else:
            mixed = self.mamba(normed, state, meta)
        hidden = hidden + mixed * self.residual_multiplier
        normed = self.post_attention_layernorm(hidden)
        ff = self.shared_mlp(normed)
        if self.block_sparse_moe is not None:
            ff = self.block_sparse_moe(normed) + ff
        return hidden + ff * self.residual_multiplier


class GraniteModel(nn.Module):
    """Embeddings, the layers and the final norm (`model.*` in the checkpoints)."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            GraniteLayer(config, i, ops, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class GraniteMoeHybridForCausalLM(Mamba2HybridForCausalLM):
    """Granite 4.0-H language model: Mamba2 and attention layers, MoE with a shared expert."""

    supports_tensor_parallel = True

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        check_silu(config)
        check_mamba2_args(self.mamba2_args(config), int(config.mamba_expand * config.hidden_size))
        pe = getattr(config, "position_embedding_type", None)
        if pe not in (None, "nope", "rope"):
            raise ValueError(f"position_embedding_type {pe!r} is not supported (rope or none)")
        self.model = GraniteModel(config, ops, tp)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.logits_scaling = float(config.logits_scaling)
        self.init_lm_head(config, ops, tp)

    @classmethod
    def attention_layers(cls, config: Any) -> list[bool]:
        return [t in ATTENTION_TYPES for t in layer_types(config)]

    @classmethod
    def mamba_layers(cls, config: Any) -> list[bool]:
        return [t in MAMBA_TYPES for t in layer_types(config)]

    @classmethod
    def mamba2_args(cls, config: Any) -> dict[str, Any]:
        return mamba2_args_from_mamba_prefix(config)

    def forward(
        self, input_ids: torch.Tensor, cache: MambaCache, meta: PagedMetadata
    ) -> torch.Tensor:
        """Runs the step's tokens `input_ids (T,)`; returns normed hidden states `(T, H)`."""
        hidden = self.model.embed_tokens(input_ids) * self.embedding_multiplier  # (T, H)
        for layer, index in zip(self.model.layers, self.state_index):
            hidden = layer(hidden, None if index is None else cache.layer(index), meta)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden (R, H)` of the sampled positions -> float32 logits `(R, V)`, divided by
        `logits_scaling`."""
        return super().compute_logits(hidden) / self.logits_scaling
