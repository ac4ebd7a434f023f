"""ZAYA1 (`ZayaForCausalLM`: `Zyphra/ZAYA1-8B`): Compressed Convolutional Attention, a top-1
MoE whose router state carries across layers, and residual scaling.

Every layer is the same, its attention full (`hybrid`) or sliding (`hybrid_sliding`, the last
`sliding_window` keys: transformers' `kv_idx > q_idx - sliding_window`) by `layer_types`:

    x = input_layernorm(h)
    h = (self_attn(x) + b1) * s1 + (h + c1) * t1          # `post_attention_residual_scale`
    x = post_attention_layernorm(h)
    y, r = mlp(x, r)                                      # r: the router state, layer to layer
    h = (y + b2) * s2 + (h + c2) * t2                     # `post_mlp_residual_scale`

with `s`, `b` the scaling's `hidden_states_scale` / `_bias` and `t`, `c` its `residual_scale`
/ `_bias`, each `(H,)`. The residual stream `h` is float32 (transformers' `residual_in_fp32`);
the norms see it in the model dtype. The embeddings are `(embed(ids) + input_hidden_states_bias)
* input_hidden_states_scale`; the final norm is `norm`; the head is tied to the embedding unless
the config says otherwise (no head bias: `lm_head_bias` is refused).

- `self_attn`: CCA (`layers.cca_attention`): q and k through a depthwise conv of width
  `cca_time0` then a grouped conv of width `cca_time1` per head (per-sequence conv history),
  q / k residuals, the value half delayed by one token (per-sequence state), L2-normed q / k to
  `sqrt(D)` with a learned key scale per KV head, RoPE per kind (`rope_parameters[kind]`,
  NeoX pairs over the first `partial_rotary_factor` of each head), softmax scale `D ** -0.5`,
  paged KV.
- `mlp`: `layers.zaya_moe` (router MLP over `router_hidden_size`, `num_experts` SwiGLU experts
  of `moe_intermediate_size` and a skip expert; one expert per token).

Checkpoint names are transformers' but the experts' stacked tensors, `mlp.experts.gate_up_proj
(E, 2F, H)` and `mlp.experts.down_proj (E, H, F)`, which load split into each expert's
`gate_proj`, `up_proj` and `down_proj` (`expand_weight`). ZAYA1-8B: 40 layers of hidden size
2048, 8 query and 2 KV heads of 128, CCA widths 2 and 2, 16 experts of 2048 and the skip
expert, router width 256, vocabulary 262272.

Tensor parallelism (`tp`): attention by heads (`Hkv` a multiple of the ranks), the experts by
their F columns, the router and scalings replicated; vocabulary-parallel embedding and head.

Glossary: T tokens in the step, H hidden size, R router hidden size.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.cca_attention import CCAttention
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.layers.zaya_moe import ZayaMoE
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.layer_types import layer_types
from vllm_mamba.models.qwen3_5 import Qwen3_5ForCausalLM
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="norm")
KINDS = ("hybrid", "hybrid_sliding")


class ResidualScaling(nn.Module):
    """`(out + hidden_states_bias) * hidden_states_scale + (h + residual_bias) *
    residual_scale`, each `(H,)`."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        for name in ("hidden_states_scale", "hidden_states_bias", "residual_scale",
                     "residual_bias"):  # fmt: skip
            self.register_parameter(name, nn.Parameter(torch.empty(hidden_size)))

    def forward(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`out (T, H)` (model dtype) and the float32 residual `(T, H)` -> float32 `(T, H)`."""
        scaled = (out + self.hidden_states_bias) * self.hidden_states_scale
        return scaled + (residual + self.residual_bias) * self.residual_scale


class ZayaDecoderLayer(nn.Module):
    """Norm, CCA, scaled residual; norm, MoE (passing the router state on), scaled residual."""

    def __init__(
        self, config: Any, index: int, kind: str, ops: MambaOps, tp: TensorParallel
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.self_attn = _attention(config, kind, ops, tp)
        self.post_attention_residual_scale = ResidualScaling(hidden)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.mlp = ZayaMoE(
            hidden, config.router_hidden_size, config.num_experts, config.moe_intermediate_size,
            eps, index > 0, config.hidden_act, ops, tp,
        )  # fmt: skip
        self.post_mlp_residual_scale = ResidualScaling(hidden)

    def forward(
        self, residual: torch.Tensor, carried: torch.Tensor | None, meta: PagedMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 residual `(T, H)` and the previous layer's router state `(T, R)` (None
        before the first layer) -> the new residual and this layer's router state."""
        dtype = self.input_layernorm.weight.dtype
        attended = self.self_attn(self.input_layernorm(residual.to(dtype)), meta)
        residual = self.post_attention_residual_scale(attended, residual)
        out, carried = self.mlp(self.post_attention_layernorm(residual.to(dtype)), carried)
        return self.post_mlp_residual_scale(out, residual), carried


def _rotary(config: Any, kind: str, head_dim: int) -> RotaryEmbedding:
    """Layer kind `kind`'s RoPE, from `rope_parameters[kind]`."""
    view = SimpleNamespace(
        rope_parameters=dict(config.rope_parameters[kind]),
        max_position_embeddings=config.max_position_embeddings,
    )
    return RotaryEmbedding.from_config(view, head_dim)


def _attention(config: Any, kind: str, ops: MambaOps, tp: TensorParallel) -> CCAttention:
    """CCA with the kind's RoPE and window."""
    head_dim = config.head_dim
    return CCAttention(
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
        kernels=(config.cca_time0, config.cca_time1), bias=bool(config.attention_bias),
        rotary=_rotary(config, kind, head_dim), ops=ops,
        sliding_window=config.sliding_window if kind == "hybrid_sliding" else None, tp=tp,
    )  # fmt: skip


class ZayaForCausalLM(CausalLM):
    """ZAYA1: CCA and MoE layers with scaled residuals (see the module docstring)."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        if config.lm_head_bias:
            raise ValueError("lm_head_bias: a biased LM head is not supported")
        if config.num_experts_per_tok != 1:
            raise ValueError(f"num_experts_per_tok must be 1, got {config.num_experts_per_tok}")
        kinds = layer_types(config, KINDS)
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[ZayaDecoderLayer(config, i, kind, ops, tp) for i, kind in enumerate(kinds)],
            norm_eps=config.rms_norm_eps,
        )  # fmt: skip
        for name in ("input_hidden_states_scale", "input_hidden_states_bias"):
            self.stack.register_parameter(name, nn.Parameter(torch.empty(config.hidden_size)))

    @staticmethod
    def expand_weight(name: str, tensor: Any) -> list[tuple[str, Any]]:
        """The experts' stacked tensors one expert at a time (as Qwen3.5-MoE's)."""
        return Qwen3_5ForCausalLM.expand_weight(name, tensor)

    def forward(self, input_ids: torch.Tensor, meta: Any) -> torch.Tensor:
        """Runs the step's tokens `input_ids (T,)`, passing each layer's router state to the
        next; returns the normed hidden states `(T, H)`."""
        stack = self.stack
        embeds = stack.token_embedding(input_ids)  # (T, H)
        scaled = (embeds + stack.input_hidden_states_bias) * stack.input_hidden_states_scale
        residual, carried = scaled.float(), None
        for layer in stack.layers:
            residual, carried = layer(residual, carried, meta)
        norm = stack.last_norm
        return norm(residual.to(norm.weight.dtype))
