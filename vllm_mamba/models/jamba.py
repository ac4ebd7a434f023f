"""Jamba (`JambaForCausalLM`: `ai21labs/Jamba-v0.1`, `Jamba-tiny-dev`, Jamba 1.5 / 1.7 Mini).

A hybrid: layer `i` is an attention layer when `i % attn_layer_period == attn_layer_offset`,
else a Mamba layer; its feed-forward is a sparse mixture of experts when
`i % expert_layer_period == expert_layer_offset` (and `num_experts > 1`), else a dense gated
MLP. Each layer is pre-norm twice (`input_layernorm` before the mixer, `pre_ff_layernorm`
before the feed-forward), with plain residuals.

- Mamba layers are Mamba's selective-SSM mixer whose time step, B and C are RMS-normalised
  with weights (`dt_layernorm`, `b_layernorm`, `c_layernorm`, epsilon `rms_norm_eps`) before
  the time-step projection and the scan; their state lives in `state_cache`.
- Attention layers have no rotary embedding and no biases; GQA with `num_key_value_heads`,
  softmax scale `head_dim ** -0.5`; their keys and values live in the paged KV cache.
- The router is transformers': softmax over the expert logits in float32, top-k of those
  probabilities, not renormalised.

Names are the Hugging Face checkpoints' (`model.embed_tokens`, `model.layers.N.mamba.*`,
`model.layers.N.self_attn.{q,k,v,o}_proj`, `model.layers.N.feed_forward.router`,
`model.layers.N.feed_forward.experts.E.{gate,up,down}_proj`, `model.final_layernorm`,
`lm_head`), so loading (sharded safetensors) is an identity mapping. The released checkpoints
all have this layout: Jamba-v0.1 and Jamba 1.5 / 1.7 Mini are 32 layers of hidden size 4096
(attention period 8 offset 4, 16 experts top-2 every other layer from layer 1, 32 query and
8 key/value heads, Mamba d_state 16, d_conv 4, expand 2, dt rank 256); Jamba-tiny-dev is a
small model of the same layout.

Tensor parallelism (`tp`): the Mamba mixers by channels (the dt/B/C norms act on the
all-reduced `x_proj` output, so they are replicated), attention by heads, the MLPs' `gate_proj`
and `up_proj` column-parallel and `down_proj` row-parallel (the experts' parts all-reduced
once per MoE layer; the router is replicated), vocabulary-parallel embedding and head.

Glossary: T tokens in the step, H hidden size, F feed-forward size, E experts, k experts per
token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mamba_mixer import MambaMixer
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.moe import ExpertList, ExpertRouter, RouterConfig, SparseMoE
from vllm_mamba.layers.self_attention import SelfAttention
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.mamba2_args import attention_head_dim, check_silu
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="final_layernorm")


def is_attention_layer(config: Any, index: int) -> bool:
    """Layer `index` is attention (else Mamba)."""
    return index % config.attn_layer_period == config.attn_layer_offset


def is_expert_layer(config: Any, index: int) -> bool:
    """Layer `index` has a sparse MoE feed-forward (else a dense MLP)."""
    return config.num_experts > 1 and index % config.expert_layer_period == (
        config.expert_layer_offset
    )


class JambaMambaMixer(MambaMixer):
    """Mamba's mixer with weighted RMS norms on the time step, B and C (so not the fused
    decode kernel, which has no such norms)."""

    fused_decode = False

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__(
            hidden_size=config.hidden_size,
            intermediate_size=config.mamba_expand * config.hidden_size,
            state_size=config.mamba_d_state,
            conv_kernel=config.mamba_d_conv,
            time_step_rank=int(config.mamba_dt_rank),
            use_bias=config.mamba_proj_bias,
            use_conv_bias=config.mamba_conv_bias,
            ops=ops,
            tp=tp,
        )
        eps = config.rms_norm_eps
        self.dt_layernorm = RMSNorm(self.time_step_rank, eps=eps)
        self.b_layernorm = RMSNorm(self.state_size, eps=eps)
        self.c_layernorm = RMSNorm(self.state_size, eps=eps)

    def _ssm_params(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`xc (T, I)` -> dt `(T, I)` (before its bias), B `(T, N)`, C `(T, N)`, normalised."""
        sizes = [self.time_step_rank, self.state_size, self.state_size]
        ts, B, C = self.x_proj(xc).split(sizes, dim=-1)  # (T, R), (T, N), (T, N)
        ts, B, C = self.dt_layernorm(ts), self.b_layernorm(B), self.c_layernorm(C)
        dt = self.ops.linear(ts, self.dt_proj.weight, None)  # (T, I), bias added in the scan
        return dt, B, C


def _moe(config: Any, ops: MambaOps, tp: TensorParallel) -> SparseMoE:
    """Top-k of `num_experts` gated MLPs, softmax-weighted and not renormalised."""
    hidden, ffn = config.hidden_size, config.intermediate_size
    route = RouterConfig("softmax_topk", config.num_experts, config.num_experts_per_tok)
    experts = ExpertList(
        GatedMLP(hidden, ffn, False, ops, tp, reduce=False) for _ in range(config.num_experts)
    )
    return SparseMoE(ExpertRouter(hidden, route, ops), experts, tp)


def _layer(config: Any, index: int, ops: MambaOps, tp: TensorParallel) -> nn.Module:
    """Norm, mixer (`mamba` or `self_attn`), residual; norm, feed-forward, residual."""
    hidden, eps = config.hidden_size, config.rms_norm_eps
    if is_attention_layer(config, index):
        head_dim = attention_head_dim(config)
        mixer = MixerPart("self_attn", SelfAttention(
            hidden, config.num_attention_heads, config.num_key_value_heads, head_dim,
            bias=False, scale=head_dim**-0.5, rotary=None, ops=ops, tp=tp,
        ))  # fmt: skip
    else:
        mixer = MixerPart("mamba", JambaMambaMixer(config, ops, tp))
    if is_expert_layer(config, index):
        ffn: nn.Module = _moe(config, ops, tp)
    else:
        ffn = GatedMLP(hidden, config.intermediate_size, False, ops, tp)
    return DecoderLayer(
        norm=("input_layernorm", RMSNorm(hidden, eps=eps)),
        mixers=[mixer],
        ffn_norm=("pre_ff_layernorm", RMSNorm(hidden, eps=eps)),
        ffns=[("feed_forward", ffn)],
    )


class JambaForCausalLM(CausalLM):
    """Jamba language model: Mamba and attention layers, a state slot and KV blocks each."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        check_silu(config)
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[_layer(config, i, ops, tp) for i in range(config.num_hidden_layers)],
            norm_eps=config.rms_norm_eps,
        )  # fmt: skip
