"""Zamba v1 (`ZambaForCausalLM`: `Zyphra/Zamba-7B-v1`).

A stack of Mamba layers (`layers_block_type`: `mamba` / `linear_attention`) in which some are
`hybrid`: before their Mamba layer they run the one shared transformer block. The layer plan
is the config's `layers_block_type` (transformers fills it: layer 2, then every
`attn_layer_period`-th layer from `3 + attn_layer_offset`). Zamba2 (`models.zamba2`) has the
same shared-block layout; its pieces are reused here:

- The shared block (`shared_transf`) reads `[h, emb] (T, 2H)` normed (`input_layernorm` over
  2H); attention over heads of `head_dim = 2H / num_attention_heads` (GQA by
  `num_key_value_heads`), softmax scale `(head_dim / 2) ** -0.5`, no position embedding, no
  biases, no adapters; then `pre_ff_layernorm` and a gated MLP `down(act(gate) * up)` with
  separate `gate_proj` / `up_proj` (`hidden_act`, GELU in the checkpoints). No residual.
- Each hybrid layer has its own KV cache layer (`PagedAttention`: the block's weights are
  shared, its keys and values per use, as transformers' cache keeps them per layer) and its
  own `linear (H, H)`; the block's output through it is added to the Mamba layer's input
  before its norm: `h = h + mamba(norm(h + linear(block(h, emb))))`.
- The Mamba layers are Mamba's selective scan split into `n_mamba_heads` heads, each with
  its own time-step, B and C projections (`layers.multihead_mamba_mixer`); the conv
  activation is `hidden_mamba_act` (SiLU). The checkpoints' `in_proj` interleaves the x and z
  channels (`[x0, z0, x1, z1, ...]`, as transformers reads it); `expand_weight` splits it into
  Mamba's `[x | z]` halves on load.

Names are the checkpoints' (`model.embed_tokens`, `model.layers.N.mamba.*`,
`model.layers.N.input_layernorm`, `model.layers.N.shared_transf.{self_attn,feed_forward,
input_layernorm,pre_ff_layernorm}.*`, `model.layers.N.linear`, `model.layers.N.mamba_decoder.*`,
`model.final_layernorm`, `lm_head`). As in transformers, the block is shared only when
`tie_word_embeddings` (the published checkpoints): it is stored under its first use (copies
under later uses are accepted); otherwise each hybrid layer loads its own copy. Zamba-7B-v1: 76
layers of hidden size 3712, 13 of them hybrid; 16 attention heads of 464 over the 7424-wide
concatenation; MLP 14848; Mamba width 7424 in 2 heads, state 16, conv 4, dt rank 232.

Tensor parallelism (`tp`): the Mamba mixers by heads; the block's attention by heads (q, k, v
column-parallel, `o_proj` row-parallel), its MLP's `gate_proj` / `up_proj` column-parallel and
`down_proj` row-parallel; each hybrid layer's `linear` replicated; vocabulary-parallel
embedding and head.

Glossary: T tokens in the step, H hidden size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.attention import PagedAttention
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mlp import GatedMLP, activation
from vllm_mamba.layers.multihead_mamba_mixer import MultiHeadMambaMixer
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.mamba2_args import check_silu
from vllm_mamba.models.zamba2 import (
    Zamba2Attention,
    Zamba2HybridLayer,
    Zamba2MambaLayer,
    head_dim_of,
    layer_types,
)
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="final_layernorm")
BLOCK_NAME = "shared_transf"
INTERLEAVED = ("mamba.in_proj.weight", "mamba.in_proj.bias")  # x and z channels alternate


def check_config(config: Any) -> None:
    """Raises ValueError naming the field when the config is outside what this model runs."""
    activation(config.hidden_act)
    check_silu(config, "hidden_mamba_act")
    width = 2 * config.hidden_size
    if config.attention_hidden_size != width:
        raise ValueError(
            f"attention_hidden_size ({config.attention_hidden_size}) must be 2 * hidden_size "
            f"({width}): the block attends over the hidden state and the embeddings"
        )
    if width % config.num_attention_heads or config.attention_head_dim != head_dim_of(config):
        raise ValueError(
            f"attention_head_dim ({config.attention_head_dim}) must be 2 * hidden_size "
            f"({width}) / num_attention_heads ({config.num_attention_heads})"
        )


class ZambaSharedBlock(nn.Module):
    """The shared transformer block: norm of `[h, emb]`, attention, norm, gated MLP; no
    residual."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Zamba2Attention(config, 0, ops, tp, adapters=False, rope=False)
        self.feed_forward = GatedMLP(
            hidden, config.intermediate_size, False, ops, tp, act=config.hidden_act
        )
        self.input_layernorm = RMSNorm(2 * hidden, eps=eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps=eps)

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        use: int,
        attn: PagedAttention,
        meta: PagedMetadata,
    ) -> torch.Tensor:
        """`hidden`, `embeds (T, H)` -> `(T, H)`, attending through use `use`'s KV layer."""
        x = self.input_layernorm(torch.cat([hidden, embeds], dim=-1))  # (T, 2H)
        x = self.self_attn(x, use, attn, meta)  # (T, H)
        return self.feed_forward(self.pre_ff_layernorm(x))


def _mamba_layer(config: Any, ops: MambaOps, tp: TensorParallel) -> Zamba2MambaLayer:
    """`h + mamba(norm(h + injected))` over the multi-head Mamba mixer."""
    mixer = MultiHeadMambaMixer(
        hidden_size=config.hidden_size,
        intermediate_size=int(config.mamba_expand * config.hidden_size),
        num_heads=config.n_mamba_heads,
        state_size=config.mamba_d_state,
        conv_kernel=config.mamba_d_conv,
        time_step_rank=int(config.mamba_dt_rank),
        use_bias=config.mamba_proj_bias,
        use_conv_bias=config.mamba_conv_bias,
        ops=ops,
        tp=tp,
    )
    return Zamba2MambaLayer(config, ops, tp, mixer=mixer)


def _layers(config: Any, ops: MambaOps, tp: TensorParallel) -> list[nn.Module]:
    """The layers; the hybrid ones share one block when `tie_word_embeddings`, else each holds
    its own copy (as transformers loads them)."""
    tied = bool(getattr(config, "tie_word_embeddings", False))
    shared = ZambaSharedBlock(config, ops, tp) if tied else None
    layers: list[nn.Module] = []
    uses = 0
    for kind in layer_types(config):
        mamba = _mamba_layer(config, ops, tp)
        if kind == "mamba":
            layers.append(mamba)
            continue
        block = shared if shared is not None else ZambaSharedBlock(config, ops, tp)
        layers.append(Zamba2HybridLayer(config, block, uses, mamba, ops, tp, BLOCK_NAME))
        uses += 1
    return layers


class ZambaForCausalLM(CausalLM):
    """Zamba v1 language model: multi-head Mamba layers and one shared attention block."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        check_config(config)
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=_layers(config, ops, tp),
            norm_eps=config.rms_norm_eps,
        )  # fmt: skip

    @staticmethod
    def expand_weight(name: str, tensor: Any) -> list[tuple[str, Any]]:
        """A Mamba `in_proj`'s interleaved rows `[x0, z0, x1, z1, ...]` -> `[x | z]`."""
        if not name.endswith(INTERLEAVED):
            return [(name, tensor)]
        whole = tensor if isinstance(tensor, torch.Tensor) else tensor[...]  # (2I, ...)
        return [(name, torch.cat([whole[0::2], whole[1::2]]))]
