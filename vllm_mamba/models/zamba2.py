"""Zamba2 (`Zamba2ForCausalLM`: `Zyphra/Zamba2-1.2B`, `Zamba2-1.2B-instruct`, `Zamba2-2.7B`,
`Zamba2-2.7B-instruct`, `Zamba2-7B`, `Zamba2-7B-instruct`).

A stack of Mamba2 layers (`layers_block_type`: `mamba` / `linear_attention`) in which some are
`hybrid`: before their Mamba2 layer they run one of `num_mem_blocks` shared transformer blocks,
reused at several depths (hybrid layer `i` runs block `i % num_mem_blocks`):

- The shared block's input is the hidden state concatenated with the original embeddings
  `(T, 2H)`, normed (`input_layernorm` over 2H); attention projects 2H to heads of
  `head_dim = 2H / num_attention_heads`, softmax scale `(head_dim / 2) ** -0.5`, RoPE when
  `use_mem_rope`; then `pre_ff_layernorm` and a gated MLP `down(act(g) * u)` (`g, u` the halves
  of `gate_up_proj`; `hidden_act`, GELU in the checkpoints). The block has no residual.
- Each use has its own adapters (LoRA: `Linear(in, adapter_rank)` then `Linear(adapter_rank,
  out)`, added to the projection): on `gate_up_proj` always, on q, k and v when
  `use_shared_attention_adapter`. Slot `i` of a block's adapter lists belongs to hybrid layer `i`
  (the other slots are empty). Each use also has its own KV cache layer: one `PagedAttention`
  per hybrid layer (the block's weights are shared, its keys and values are not).
- The block's output goes through the layer's own `linear (H, H)` and is added to the Mamba2
  layer's input before its norm; the residual is the hidden state without it:
  `h = h + mamba(norm(h + linear(block(h, emb))))`.
- Mamba2 is the SSD mixer (state in `mamba_cache`), conv with bias, gated norm eps 1e-5 as
  transformers has it, time step clamped below at `time_step_min` in prefill (not in decode, as
  transformers and mamba-ssm).

Names are the checkpoints' (`model.embed_tokens`, `model.layers.N.mamba.*`,
`model.layers.N.input_layernorm`, `model.layers.N.shared_transformer.{self_attn,feed_forward,
input_layernorm,pre_ff_layernorm}.*`, `model.layers.N.linear`, `model.layers.N.mamba_decoder.*`,
`model.final_layernorm`, `lm_head` tied to the embeddings). A shared block's tensors are stored
under its first use; copies under later uses, where a checkpoint has them, are accepted (tied
names). As in transformers, the blocks are shared only when `tie_word_embeddings` (all the
published checkpoints): otherwise each hybrid layer loads its own copy. Zamba2-1.2B: 38
layers of hidden size 2048, 6 of them hybrid, sharing one block (attention over the 4096-wide
concatenation, adapters of rank 128); Zamba2-2.7B (54 layers) and -7B (81): two shared blocks
used alternately.

Tensor parallelism (`tp`): Mamba2 by heads; the shared blocks' attention by heads (q, k, v
column-parallel with their adapters' second factor, `o_proj` row-parallel), their MLP's
`gate_up_proj` halves each split (and its adapter's second factor), `down_proj` row-parallel;
adapters' first factors and each hybrid layer's `linear` replicated (their inputs are whole);
vocabulary-parallel embedding and head.

Zamba v1 (`models.zamba`) builds on the attention (without adapters and RoPE), the Mamba layer
(with its multi-head Mamba mixer) and the hybrid layer.

Glossary: T tokens in the step, H hidden size, F MLP size, R adapter rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.attention import PagedAttention
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.decode_plan import DecodePlan, DecodeScope, PlannedLayer
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.mamba2_mixer import Mamba2Mixer
from vllm_mamba.layers.mixer_sharding import kv_head_ranges
from vllm_mamba.layers.mlp import ACTIVATIONS, activation
from vllm_mamba.layers.parallel_linear import (
    Ranges,
    column_linear,
    row_linear,
)
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.layers.rowwise import rowwise
from vllm_mamba.models.causal_lm import CausalLM, ReadsEmbeddings, StackNames
from vllm_mamba.models.mamba2_args import check_mamba2_args
from vllm_mamba.ops.table import MambaOps

MAMBA_TYPES = ("mamba", "linear_attention")
NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="final_layernorm")
GATED_NORM_EPS = 1e-5  # transformers' Zamba2MambaMixer hard-codes it


def layer_types(config: Any) -> list[str]:
    """Each layer's kind, `mamba` or `hybrid`, checked."""
    types = ["mamba" if t in MAMBA_TYPES else t for t in config.layers_block_type]
    if len(types) != config.num_hidden_layers or set(types) - {"mamba", "hybrid"}:
        raise ValueError(
            f"layers_block_type must name {config.num_hidden_layers} layers, each mamba or "
            f"hybrid; got {config.layers_block_type}"
        )
    return types


def check_config(config: Any) -> None:
    """Raises ValueError naming the field when the config is outside what this model runs."""
    activation(config.hidden_act)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if (2 * config.hidden_size) % heads:
        raise ValueError(
            f"num_attention_heads ({heads}) must divide the attention width 2 * hidden_size "
            f"({2 * config.hidden_size})"
        )
    if config.use_shared_attention_adapter and kv_heads != heads:
        raise ValueError(
            f"use_shared_attention_adapter needs num_key_value_heads ({kv_heads}) equal to "
            f"num_attention_heads ({heads}): the k and v adapters are 2 * hidden_size wide"
        )
    width = int(config.mamba_expand * config.hidden_size)
    check_mamba2_args(mamba2_args(config), width)


def adapter_list(
    num_uses: int,
    num_blocks: int,
    block: int,
    sizes: tuple[int, int, list[int]],
    ops: MambaOps,
    tp: TensorParallel = SINGLE,
    ranges: Ranges | None = None,
) -> nn.ModuleList:
    """Slot `i` holds hybrid layer `i`'s LoRA `(in -> R -> out)` when block `block` serves it,
    else nothing (`nn.Identity`, never called): the checkpoints' `*_adapter_list.I.{0,1}`.
    The second factor is split like the projection it adds to (`sizes[2]` its sections,
    `ranges` its explicit rows)."""
    d_in, rank, d_out = sizes
    return nn.ModuleList(
        nn.Sequential(
            Linear(d_in, rank, False, ops), column_linear(rank, d_out, False, ops, tp, ranges)
        )
        if i % num_blocks == block
        else nn.Identity()
        for i in range(num_uses)
    )


class Zamba2Attention(nn.Module):
    """The shared block's projections, its use's adapters (`adapters`) and RoPE (`rope`); the
    paged attention is the caller's. Zamba v1's block has neither."""

    def __init__(
        self,
        config: Any,
        block: int,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
        *,
        adapters: bool,
        rope: bool,
    ) -> None:
        super().__init__()
        width, head_dim = 2 * config.hidden_size, head_dim_of(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        tp.split(heads, "num_attention_heads")
        kv_ranges, _ = kv_head_ranges(kv_heads, head_dim, tp)
        q_size, kv_size = [heads * head_dim], [kv_heads * head_dim]
        self.q_proj = column_linear(width, q_size, False, ops, tp)
        self.k_proj = column_linear(width, kv_size, False, ops, tp, kv_ranges)
        self.v_proj = column_linear(width, kv_size, False, ops, tp, kv_ranges)
        self.o_proj = row_linear(heads * head_dim, config.hidden_size, False, ops, tp)
        self.use_adapters = adapters
        if adapters:
            args = (len(config.hybrid_layer_ids), config.num_mem_blocks, block)
            rank = config.adapter_rank
            self.linear_q_adapter_list = adapter_list(*args, (width, rank, q_size), ops, tp)
            self.linear_k_adapter_list = adapter_list(
                *args, (width, rank, kv_size), ops, tp, kv_ranges
            )
            self.linear_v_adapter_list = adapter_list(
                *args, (width, rank, kv_size), ops, tp, kv_ranges
            )
        self.rotary = None
        if rope:
            # transformers rotates whole heads
            self.rotary = RotaryEmbedding.from_config(config, head_dim, rot_dim=head_dim)

    def forward(
        self, x: torch.Tensor, use: int, attn: PagedAttention, meta: PagedMetadata
    ) -> torch.Tensor:
        """`x (T, 2H)` normed, for hybrid layer `use` with its KV layer `attn` -> `(T, H)`."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_adapters:
            q = q + self.linear_q_adapter_list[use](x)
            k = k + self.linear_k_adapter_list[use](x)
            v = v + self.linear_v_adapter_list[use](x)
        if self.rotary is not None:
            q, k = self.rotary(meta.rope_positions, q, k, meta)
        return self.o_proj(attn(q, k, v, meta))


class Zamba2MLP(nn.Module):
    """`down(act(g) * u)`, `g, u` the halves of `gate_up_proj(x)` plus the use's adapter."""

    def __init__(self, config: Any, block: int, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        hidden, ffn, bias = config.hidden_size, config.intermediate_size, config.add_bias_linear
        self.gate_up_proj = column_linear(hidden, [ffn, ffn], bias, ops, tp)
        self.down_proj = row_linear(ffn, hidden, bias, ops, tp)
        args = (len(config.hybrid_layer_ids), config.num_mem_blocks, block)
        self.gate_up_proj_adapter_list = adapter_list(
            *args, (hidden, config.adapter_rank, [ffn, ffn]), ops, tp
        )
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, use: int) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`."""
        gate_up = self.gate_up_proj(x) + self.gate_up_proj_adapter_list[use](x)  # (T, 2F)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(rowwise(self.act, gate) * up)  # each row as alone


class Zamba2SharedBlock(nn.Module):
    """One shared transformer block (`shared_transformer`): norm of `[h, emb]`, attention,
    norm, MLP; no residual."""

    def __init__(self, config: Any, block: int, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = Zamba2Attention(
            config, block, ops, tp,
            adapters=bool(config.use_shared_attention_adapter), rope=bool(config.use_mem_rope),
        )  # fmt: skip
        self.feed_forward = Zamba2MLP(config, block, ops, tp)
        self.input_layernorm = RMSNorm(2 * config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        use: int,
        attn: PagedAttention,
        meta: PagedMetadata,
    ) -> torch.Tensor:
        """`hidden`, `embeds (T, H)` -> `(T, H)` for hybrid layer `use`."""
        x = self.input_layernorm(torch.cat([hidden, embeds], dim=-1))  # (T, 2H)
        x = self.self_attn(x, use, attn, meta)
        return self.feed_forward(self.pre_ff_layernorm(x), use)


class Zamba2MambaLayer(PlannedLayer):
    """`h + mamba(norm(h + injected))`; `injected` is a hybrid layer's block output. Its decode
    plan may fuse the mixer's call alone (`layers.decode_plan`). The mixer is Zamba2's Mamba2
    unless `mixer` is given (Zamba v1's multi-head Mamba)."""

    def __init__(
        self,
        config: Any,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
        mixer: StatefulLayer | None = None,
    ) -> None:
        super().__init__()
        self.mamba = (
            mixer if mixer is not None else Mamba2Mixer(**mamba2_args(config), ops=ops, tp=tp)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def make_decode_plan(self) -> DecodePlan | None:
        """The mixer's fused step without the norm, when it offers one."""
        step = self.mamba.fused_mixer_step(None, False)
        return None if step is None else DecodePlan(DecodeScope.MIXER, step, "mamba")

    def forward(
        self, hidden: torch.Tensor, meta: PagedMetadata, injected: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`."""
        x = self.input_layernorm(hidden if injected is None else hidden + injected)
        plan = self.decode_plan
        fused = plan is not None and plan.step.takes(x, meta)
        return hidden + (plan.step(x, meta) if fused else self.mamba(x, meta))


class Zamba2HybridLayer(ReadsEmbeddings):
    """A shared block (use `use`, under the checkpoint's name `block_name`), the layer's
    `linear`, then its Mamba layer `mamba_decoder`; `attn` is this use's KV cache layer. The
    block is called `block(hidden, embeds, use, attn, meta)` (Zamba v1's too)."""

    def __init__(
        self,
        config: Any,
        shared: nn.Module,
        use: int,
        mamba_decoder: Zamba2MambaLayer,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
        block_name: str = "shared_transformer",
    ) -> None:
        super().__init__()
        self.add_module(block_name, shared)
        self.block_name = block_name
        self.linear = Linear(config.hidden_size, config.hidden_size, False, ops)
        self.mamba_decoder = mamba_decoder
        head_dim = head_dim_of(config)
        heads = tp.split(config.num_attention_heads, "num_attention_heads")  # this rank's
        _, kv_heads = kv_head_ranges(config.num_key_value_heads, head_dim, tp)
        self.attn = PagedAttention(heads, kv_heads, head_dim, (head_dim / 2) ** -0.5, ops)
        self.use = use

    def forward(
        self, hidden: torch.Tensor, meta: PagedMetadata, embeds: torch.Tensor
    ) -> torch.Tensor:
        """`hidden`, `embeds (T, H)` -> `(T, H)`."""
        block = getattr(self, self.block_name)
        block_out = block(hidden, embeds, self.use, self.attn, meta)
        return self.mamba_decoder(hidden, meta, injected=self.linear(block_out))


def _layers(config: Any, ops: MambaOps, tp: TensorParallel) -> list[nn.Module]:
    """The layers; hybrid layers hold the shared blocks (untied copies unless
    `tie_word_embeddings`, as transformers loads them)."""
    blocks = [Zamba2SharedBlock(config, b, ops, tp) for b in range(config.num_mem_blocks)]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    layers: list[nn.Module] = []
    for kind in layer_types(config):
        if kind == "hybrid":
            use = sum(isinstance(m, Zamba2HybridLayer) for m in layers)
            block_id = use % config.num_mem_blocks
            if tied or use < config.num_mem_blocks:
                block = blocks[block_id]
            else:  # an untied copy, as transformers loads it
                block = Zamba2SharedBlock(config, block_id, ops, tp)
            mamba = Zamba2MambaLayer(config, ops, tp)
            layers.append(Zamba2HybridLayer(config, block, use, mamba, ops, tp))
        else:
            layers.append(Zamba2MambaLayer(config, ops, tp))
    return layers


def head_dim_of(config: Any) -> int:
    """`2H / num_attention_heads` (the block attends over the concatenated input)."""
    return 2 * config.hidden_size // config.num_attention_heads


def mamba2_args(config: Any) -> dict[str, Any]:
    """`Mamba2Mixer` arguments from Zamba2's config names."""
    heads = config.n_mamba_heads
    return dict(
        hidden_size=config.hidden_size,
        num_heads=heads,
        head_dim=int(config.mamba_expand * config.hidden_size) // heads,
        n_groups=config.mamba_ngroups,
        state_size=config.mamba_d_state,
        conv_kernel=config.mamba_d_conv,
        chunk_size=config.chunk_size,
        time_step_limit=(float(config.time_step_min), float("inf")),
        use_bias=config.add_bias_linear,
        use_conv_bias=True,  # transformers' conv1d always has a bias
        norm_eps=GATED_NORM_EPS,
    )


class Zamba2ForCausalLM(CausalLM):
    """Zamba2 language model: Mamba2 layers and shared attention blocks with per-use adapters."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        check_config(config)
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=_layers(config, ops, tp),
            norm_eps=config.rms_norm_eps,
        )  # fmt: skip
