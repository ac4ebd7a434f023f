"""Falcon-H1 (`FalconH1ForCausalLM`: `tiiuae/Falcon-H1-0.5B-Instruct`, `-1.5B`, `-3B`, `-7B`,
`-34B`, base and instruct).

Every layer runs attention and Mamba2 side by side on the same normed input and adds both to the
residual, then a gated MLP: `h += ssm_out * mamba(n) + attn_out * attn(attn_in * n)` with
`n = input_layernorm(h)`, then `h += mlp(pre_ff_layernorm(h))`. The muP multipliers are
transformers': embeddings times `embedding_multiplier`, logits times `lm_head_multiplier`, the
MLP's gate input times `mlp_multipliers[0]` and its output times `mlp_multipliers[1]`, keys times
`key_multiplier`, the Mamba2 input times `ssm_in_multiplier` and its projection `zxbcdt` times
`ssm_multipliers` (one factor each for z, x, B, C and dt).

- The Mamba2 mixer's width is `mamba_d_ssm` (else `mamba_expand * hidden_size`); its gated
  RMSNorm is optional (`mamba_rms_norm`; without it the output is `y * silu(z)`) and may
  normalise before gating (`mamba_norm_before_gate`); `out_proj` has `projectors_bias`.
- Attention rotates queries and keys with RoPE (`rope_parameters`), GQA, scale
  `head_dim ** -0.5`.

Names are the checkpoints' (`model.embed_tokens`, `model.layers.N.mamba.*`,
`model.layers.N.self_attn.*`, `model.layers.N.feed_forward.*`, `model.final_layernorm`,
`lm_head`). Falcon-H1-0.5B: 36 layers of hidden size 1024, 8 query and 2 key/value heads of 64,
Mamba2 width 1536 in 24 heads of 64, d_state 128, one group, conv 4.

Tensor parallelism (`tp`): Mamba2 and attention by heads (the muP section scales follow each
rank's sections), the MLP's `gate_proj` and `up_proj` column-parallel and `down_proj`
row-parallel, vocabulary-parallel embedding and head. A norm before the gate needs whole
groups on each rank.

Glossary: T tokens in the step, H hidden size, I Mamba2 width, NH heads, P head dim, G groups,
N state size, CD conv channels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.layernorm import RMSNorm, weightless_rms_norm
from vllm_mamba.layers.mamba2_mixer import Mamba2Mixer
from vllm_mamba.layers.parallel_linear import column_linear, row_linear, vocab_embedding
from vllm_mamba.layers.parallel_norm import SplitGroupGatedRMSNorm
from vllm_mamba.layers.self_attention import SelfAttention
from vllm_mamba.mamba_cache import LayerState, MambaCache
from vllm_mamba.models.bamba import make_rotary
from vllm_mamba.models.mamba2_hybrid import (
    Mamba2HybridForCausalLM,
    check_mamba2_args,
    check_silu,
)
from vllm_mamba.ops.table import MambaOps


def _ssm_width(config: Any) -> int:
    d_ssm = getattr(config, "mamba_d_ssm", None)
    return int(d_ssm) if d_ssm is not None else int(config.mamba_expand * config.hidden_size)


class FalconH1Mixer(Mamba2Mixer):
    """Mamba2 with Falcon-H1's input multiplier, per-section projection multipliers, optional
    gated norm (before or after the gate) and its own `out_proj` bias."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__(**FalconH1ForCausalLM.mamba2_args(config), ops=ops, tp=tp)
        self.ssm_in_multiplier = float(config.ssm_in_multiplier)
        self.ssm_multipliers = [float(m) for m in config.ssm_multipliers]
        self.norm_before_gate = bool(config.mamba_norm_before_gate)
        if not config.mamba_rms_norm:
            self.norm = None
        elif self.norm_before_gate and isinstance(self.norm, SplitGroupGatedRMSNorm):
            raise ValueError(
                f"Falcon-H1 with mamba_norm_before_gate: mamba_n_groups "
                f"({config.mamba_n_groups}) must be a multiple of tensor_parallel_size ({tp.size})"
            )
        self.out_proj = row_linear(_ssm_width(config), config.hidden_size,
                                   config.projectors_bias, ops, tp)  # fmt: skip
        self.register_buffer("mup_vector", torch.empty(0), persistent=False)

    def process_weights_after_loading(self) -> None:
        """Also builds `mup_vector (I + CD + NH,)`: z, x, B, C and dt sections scaled."""
        super().process_weights_after_loading()
        gn = self.n_groups * self.state_size
        sizes = [self.intermediate_size, self.intermediate_size, gn, gn, self.num_heads]
        device = self.dt_bias.device
        self.mup_vector = torch.cat(
            [torch.full((n,), m, device=device) for n, m in zip(sizes, self.ssm_multipliers)]
        ).to(self.dt_bias.dtype)

    def _gate(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """`y, z (T, I)` -> gated and (optionally) normalised `(T, I)`."""
        if self.norm is None:
            return y * F.silu(z)
        if not self.norm_before_gate:
            return self.norm(y, z)
        groups = y.reshape(y.shape[0], self.n_groups, -1)  # (T, G, I / G)
        normed = weightless_rms_norm(groups, self.norm.variance_epsilon).reshape(y.shape)
        return (self.norm.weight * normed.float() * F.silu(z.float())).to(y.dtype)

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The input projection with the SSM input multiplier and the muP section scales."""
        return self.in_proj(hidden * self.ssm_in_multiplier) * self.mup_vector


class FalconH1MLP(nn.Module):
    """`down(up(x) * silu(gate(x) * gate_mult)) * down_mult`."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        hidden, ffn, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = column_linear(hidden, [ffn], bias, ops, tp)
        self.up_proj = column_linear(hidden, [ffn], bias, ops, tp)
        self.down_proj = row_linear(ffn, hidden, bias, ops, tp)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in config.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`."""
        y = self.up_proj(x) * F.silu(self.gate_proj(x) * self.gate_multiplier)
        return self.down_proj(y) * self.down_multiplier


class FalconH1Layer(nn.Module):
    """Norm; Mamba2 and attention in parallel, scaled and added; norm, MLP, residual."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        head_dim = FalconH1ForCausalLM.head_dim(config)
        self.mamba = FalconH1Mixer(config, ops, tp)
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
            bias=config.attention_bias, scale=head_dim**-0.5,
            rotary=make_rotary(config, head_dim), ops=ops,
            key_multiplier=float(config.key_multiplier), tp=tp,
        )  # fmt: skip
        self.feed_forward = FalconH1MLP(config, ops, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_in_multiplier = float(config.attention_in_multiplier)
        self.ssm_out_multiplier = float(config.ssm_out_multiplier)
        self.attn_out_multiplier = float(config.attention_out_multiplier)

    def forward(self, hidden: torch.Tensor, state: LayerState, meta: PagedMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`; `state` is the layer's Mamba2 cache view."""
        normed = self.input_layernorm(hidden)
        ssm = self.mamba(normed, state, meta) * self.ssm_out_multiplier
        attn = self.self_attn(normed * self.attention_in_multiplier, meta)
        hidden = hidden + (ssm + attn * self.attn_out_multiplier)
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


class FalconH1Model(nn.Module):
    """Embeddings, the layers and the final norm (`model.*` in the checkpoints)."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            FalconH1Layer(config, ops, tp) for _ in range(config.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class FalconH1ForCausalLM(Mamba2HybridForCausalLM):
    """Falcon-H1 language model: attention and Mamba2 in parallel in every layer."""

    supports_tensor_parallel = True

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        check_silu(config)
        check_mamba2_args(self.mamba2_args(config), _ssm_width(config))
        self.model = FalconH1Model(config, ops, tp)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.lm_head_multiplier = float(config.lm_head_multiplier)
        self.init_lm_head(config, ops, tp)

    @classmethod
    def attention_layers(cls, config: Any) -> list[bool]:
        return [True] * config.num_hidden_layers

    @classmethod
    def mamba_layers(cls, config: Any) -> list[bool]:
        return [True] * config.num_hidden_layers

    @classmethod
    def mamba2_args(cls, config: Any) -> dict[str, Any]:
        limit = getattr(config, "time_step_limit", None) or (0.0, float("inf"))
        return dict(
            hidden_size=config.hidden_size,
            num_heads=config.mamba_n_heads,
            head_dim=config.mamba_d_head,
            n_groups=config.mamba_n_groups,
            state_size=config.mamba_d_state,
            conv_kernel=config.mamba_d_conv,
            chunk_size=config.mamba_chunk_size,
            time_step_limit=tuple(limit),
            use_bias=config.mamba_proj_bias,
            use_conv_bias=config.mamba_conv_bias,
            norm_eps=config.rms_norm_eps,
        )

    def forward(
        self, input_ids: torch.Tensor, cache: MambaCache, meta: PagedMetadata
    ) -> torch.Tensor:
        """Runs the step's tokens `input_ids (T,)`; returns normed hidden states `(T, H)`."""
        hidden = self.model.embed_tokens(input_ids) * self.embedding_multiplier  # (T, H)
        for layer, index in zip(self.model.layers, self.state_index):
            hidden = layer(hidden, cache.layer(index), meta)
        return self.model.final_layernorm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden (R, H)` of the sampled positions -> float32 logits `(R, V)`, times
        `lm_head_multiplier`."""
        return super().compute_logits(hidden) * self.lm_head_multiplier
