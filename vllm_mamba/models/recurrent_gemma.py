"""RecurrentGemma (`RecurrentGemmaForCausalLM`: `google/recurrentgemma-2b`, `-9b` and their
`-it`): Griffin's recurrent blocks and local (sliding-window) attention.

Layers follow `block_types` repeated over the depth (`recurrent`, `recurrent`, `attention` by
default). Every layer is pre-norm twice with zero-centred RMSNorms (`1 + w`) and plain
residuals:

    h = h + temporal_block(temporal_pre_norm(h))   # `RecurrentBlock` or local attention
    h = h + mlp_block(channel_pre_norm(h))         # down(act(gate(x)) * up(x)), with biases

- Recurrent layers (`layers.rglru_block.RecurrentBlock`): the RG-LRU over a conv of width
  `conv1d_width`, `lru_width` channels in `num_attention_heads` gate heads.
- Attention layers: `q_proj`, `k_proj`, `v_proj` without biases, `o_proj` with one; GQA / MQA
  by `num_key_value_heads`; RoPE (`rotate_half` pairing) over the first `partial_rotary_factor`
  (0.5 by default) of each head; softmax scale `D ** -0.5`; a sliding window of
  `attention_window_size` tokens (a query reads its own and the window - 1 before it), so the
  KV cache holds at most the window (plus a chunk) per sequence.
- The embeddings are scaled by `sqrt(hidden_size)` rounded to bfloat16 (transformers'
  `normalizer`), the final norm is `final_norm`, the head is tied to the embedding, and the
  logits are soft-capped: `cap * tanh(logits / cap)` (`logits_soft_cap`).
- The MLP's width is `intermediate_size // 2`, its activation `hidden_activation`.

Checkpoint names are the engine's (`model.layers.N.temporal_block.*`, `mlp_block.*`) but for
the MLP's `gate_proj`, `up_proj`, `down_proj`, which are `layers.mlp.GatedMLP`'s own.
RecurrentGemma-2B: 26 layers of hidden size 2560 (`lru_width` 2560, 10 heads; attention MQA
with 1 KV head of 256), window 2048, vocabulary 256000.

Tensor parallelism (`tp`): the recurrent blocks by gate heads, attention by query heads (the
single KV head replicated), the MLPs column- then row-parallel; vocabulary-parallel embedding
and head.

Glossary: H hidden size, L `lru_width`, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.layernorm import ZeroCenteredRMSNorm
from vllm_mamba.layers.mlp import GatedMLP, activation
from vllm_mamba.layers.rglru_block import RecurrentBlock
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.layers.self_attention import SelfAttention
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="final_norm")
KINDS = {"recurrent", "attention"}


def block_kinds(config: Any) -> list[str]:
    """Each layer's kind: `block_types` repeated over `num_hidden_layers`."""
    kinds = list(config.block_types)
    if not kinds or set(kinds) - KINDS:
        raise ValueError(f"block_types must be a non-empty list of {sorted(KINDS)}, got {kinds}")
    return [kinds[i % len(kinds)] for i in range(config.num_hidden_layers)]


def _attention(config: Any, ops: MambaOps, tp: TensorParallel) -> SelfAttention:
    """Local attention: partial RoPE, an output bias, a window of `attention_window_size`."""
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    return SelfAttention(
        config.hidden_size, heads, config.num_key_value_heads, head_dim,
        bias=bool(config.attention_bias), out_bias=True, scale=head_dim**-0.5,
        rotary=RotaryEmbedding.from_config(config, head_dim), ops=ops,
        sliding_window=config.attention_window_size, tp=tp,
    )  # fmt: skip


def _layer(config: Any, kind: str, ops: MambaOps, tp: TensorParallel) -> nn.Module:
    """Norm, recurrent block or local attention, residual; norm, MLP, residual."""
    hidden, eps = config.hidden_size, config.rms_norm_eps
    act = activation(config.hidden_activation, "hidden_activation")
    if kind == "recurrent":
        block: nn.Module = RecurrentBlock(
            hidden, config.lru_width, config.num_attention_heads, config.conv1d_width, act,
            ops, tp,
        )  # fmt: skip
    else:
        block = _attention(config, ops, tp)
    mlp = GatedMLP(
        hidden, config.intermediate_size // 2, True, ops, tp, act=config.hidden_activation
    )
    return DecoderLayer(
        norm=("temporal_pre_norm", ZeroCenteredRMSNorm(hidden, eps=eps)),
        mixers=[MixerPart("temporal_block", block)],
        ffn_norm=("channel_pre_norm", ZeroCenteredRMSNorm(hidden, eps=eps)),
        ffns=[("mlp_block", mlp)],
    )


class RecurrentGemmaForCausalLM(CausalLM):
    """RecurrentGemma: recurrent blocks and local attention (see the module docstring)."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        # transformers scales the embeddings by sqrt(H) held in bfloat16
        normalizer = torch.tensor(
            config.hidden_size**0.5, dtype=torch.bfloat16, device="cpu"
        ).item()
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[_layer(config, kind, ops, tp) for kind in block_kinds(config)],
            norm_eps=config.rms_norm_eps, embedding_multiplier=normalizer,
            final_norm_cls=ZeroCenteredRMSNorm,
        )  # fmt: skip
        self.soft_cap = float(config.logits_soft_cap)

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`cap * tanh(logits / cap)` (float32 `(R, V)`)."""
        return torch.tanh(logits / self.soft_cap) * self.soft_cap
