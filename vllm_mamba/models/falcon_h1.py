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

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.layernorm import RMSNorm, weightless_rms_norm
from vllm_mamba.layers.mamba2_mixer import Mamba2Mixer
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.parallel_linear import row_linear
from vllm_mamba.layers.parallel_norm import SplitGroupGatedRMSNorm
from vllm_mamba.layers.self_attention import SelfAttention
from vllm_mamba.models.bamba import make_rotary
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.mamba2_args import (
    attention_head_dim,
    check_mamba2_args,
    check_silu,
    mamba2_args_from_mamba_prefix,
)
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="final_layernorm")


def _ssm_width(config: Any) -> int:
    d_ssm = getattr(config, "mamba_d_ssm", None)
    return int(d_ssm) if d_ssm is not None else int(config.mamba_expand * config.hidden_size)


class FalconH1Mixer(Mamba2Mixer):
    """Mamba2 with Falcon-H1's input multiplier, per-section projection multipliers, optional
    gated norm (before or after the gate) and its own `out_proj` bias (so not the fused decode
    kernel, which has none of them)."""

    fused_decode = False

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__(**mamba2_args_from_mamba_prefix(config), ops=ops, tp=tp)
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


def _layer(config: Any, ops: MambaOps, tp: TensorParallel) -> nn.Module:
    """Norm; Mamba2 and attention in parallel, scaled and added; norm, MLP, residual."""
    hidden, eps = config.hidden_size, config.rms_norm_eps
    head_dim = attention_head_dim(config)
    attn = SelfAttention(
        hidden, config.num_attention_heads, config.num_key_value_heads, head_dim,
        bias=config.attention_bias, scale=head_dim**-0.5, rotary=make_rotary(config, head_dim),
        ops=ops, key_multiplier=float(config.key_multiplier), tp=tp,
    )  # fmt: skip
    gate_mult, down_mult = (float(m) for m in config.mlp_multipliers)
    mlp = GatedMLP(hidden, config.intermediate_size, config.mlp_bias, ops, tp,
                   gate_multiplier=gate_mult, down_multiplier=down_mult)  # fmt: skip
    return DecoderLayer(
        norm=("input_layernorm", RMSNorm(hidden, eps=eps)),
        mixers=[
            MixerPart(
                "mamba", FalconH1Mixer(config, ops, tp), out_scale=float(config.ssm_out_multiplier)
            ),
            MixerPart(
                "self_attn",
                attn,
                in_scale=float(config.attention_in_multiplier),
                out_scale=float(config.attention_out_multiplier),
            ),
        ],  # fmt: skip
        ffn_norm=("pre_ff_layernorm", RMSNorm(hidden, eps=eps)),
        ffns=[("feed_forward", mlp)],
    )


class FalconH1ForCausalLM(CausalLM):
    """Falcon-H1 language model: attention and Mamba2 in parallel in every layer."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        check_silu(config)
        check_mamba2_args(mamba2_args_from_mamba_prefix(config), _ssm_width(config))
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[_layer(config, ops, tp) for _ in range(config.num_hidden_layers)],
            norm_eps=config.rms_norm_eps,
            embedding_multiplier=config.embedding_multiplier,
        )  # fmt: skip
        self.lm_head_multiplier = float(config.lm_head_multiplier)

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits times `lm_head_multiplier`."""
        return logits * self.lm_head_multiplier
