"""OLMo Hybrid (`OlmoHybridForCausalLM`: `allenai/Olmo-Hybrid-7B` and its instruct variants).

Gated DeltaNet and attention layers by `layer_types` (`linear_attention` / `full_attention`,
attention every 4th layer in the releases), with plain RMSNorms (`weight * x / rms(x)`,
`rms_norm_eps`), dense SwiGLU MLPs and plain residuals; the two kinds of layer place their
norms differently (`layers.decoder_layer` takes a norm before a stage's parts, after, or both):

    GDN layer:        h = h + linear_attn(input_layernorm(h))
                      h = h + mlp(post_attention_layernorm(h))
    attention layer:  h = h + post_attention_layernorm(self_attn(h))       (post-norm only)
                      h = h + post_feedforward_layernorm(mlp(h))

- GDN layers (`linear_attn.*`): `q_proj`, `k_proj`, `v_proj`, `g_proj` (the output gate),
  `a_proj`, `b_proj`, convs `q_conv1d`, `k_conv1d`, `v_conv1d`, `A_log`, `dt_bias`, `o_norm`
  (its epsilon is 1e-5, FLA's default, not the config's), `o_proj`; `beta = 2 sigmoid(b)` with
  `linear_allow_neg_eigval` (eigenvalues of the state transition in [-1, 1]), else `sigmoid(b)`
  (`layers.gated_deltanet.OlmoHybridGatedDeltaNet`).
- Attention layers (`self_attn.*`): `q_norm` and `k_norm` over the whole query and key
  projections (`(Hq D,)` and `(Hkv D,)`, not per head), GQA, softmax scale `D ** -0.5`, RoPE
  over whole heads only when `rope_parameters` has a `rope_theta` (the released checkpoints
  set it to null: no position embedding, NoPE).

Checkpoint names: the layers' pre-norms are saved as `attention_layer_norm` and
`feedforward_layer_norm` (transformers renames them on load; so does `remap_weight_name`, onto
`input_layernorm` and `post_attention_layernorm`). The three GDN convs are rows of one
`[q | k | v]` conv: the released checkpoints hold them at their sizes (`(Hk Dk, 1, K)` twice,
`(Hv Dv, 1, K)`), transformers' `save_pretrained` as three equal thirds of the whole (its
`Concatenate` reverted by an even split); `expand_weight` gathers a layer's three and cuts them
at the real sizes, so both load. Olmo-Hybrid-7B: 32 layers of hidden size
3840, 30 heads of 128, GDN with 30 key heads of 96 and 30 value heads of 192, vocabulary 100352.

Tensor parallelism (`tp`): GDN by key heads and their value heads, attention by heads with the
q/k norms' statistics all-reduced over the ranks (`layers.parallel_norm.projection_rms_norm`),
MLPs column- then row-parallel; vocabulary-parallel embedding and head.

Glossary: Hq / Hkv query / key-value heads, D head dim.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.gated_deltanet import OlmoHybridGatedDeltaNet
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mixer_sharding import kv_head_ranges
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.parallel_norm import projection_rms_norm
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.layers.self_attention import SelfAttention
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.layer_types import layer_types
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="norm")
GDN_NORM_EPS = 1e-5  # the GDN output norm's epsilon (FLA's FusedRMSNormGated default)
# The checkpoints' names of the layers' pre-norms -> this model's (as transformers renames them).
_NORM_NAMES = {
    ".attention_layer_norm.": ".input_layernorm.",
    ".feedforward_layer_norm.": ".post_attention_layernorm.",
}
_CONV_PIECE = re.compile(r"(.*\.linear_attn\.)([qkv])_conv1d\.weight")


def _gdn(config: Any, ops: MambaOps, tp: TensorParallel) -> OlmoHybridGatedDeltaNet:
    return OlmoHybridGatedDeltaNet(
        config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
        config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim,
        GDN_NORM_EPS, ops, tp, beta_scale=2.0 if config.linear_allow_neg_eigval else 1.0,
    )  # fmt: skip


def _rotary(config: Any, head_dim: int) -> RotaryEmbedding | None:
    """RoPE over whole heads when the config sets `rope_theta`, else None (NoPE)."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_theta") is None:
        return None
    return RotaryEmbedding.from_config(config, head_dim, rot_dim=head_dim)


def _attention(config: Any, ops: MambaOps, tp: TensorParallel) -> SelfAttention:
    """Attention with RMSNorms over the whole query and key projections."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    eps = config.rms_norm_eps
    kv_ranges, _ = kv_head_ranges(kv_heads, head_dim, tp)
    return SelfAttention(
        config.hidden_size, heads, kv_heads, head_dim, bias=config.attention_bias,
        scale=head_dim**-0.5, rotary=_rotary(config, head_dim), ops=ops,
        q_norm=projection_rms_norm(heads * head_dim, eps, tp),
        k_norm=projection_rms_norm(kv_heads * head_dim, eps, tp, kv_ranges),
        qk_norm_per_head=False, tp=tp,
    )  # fmt: skip


def _layer(config: Any, kind: str, ops: MambaOps, tp: TensorParallel) -> nn.Module:
    """A pre-norm GDN layer or a post-norm attention layer (see the module docstring)."""
    hidden, eps = config.hidden_size, config.rms_norm_eps
    mlp = GatedMLP(hidden, config.intermediate_size, False, ops, tp)
    if kind == "linear_attention":
        return DecoderLayer(
            norm=("input_layernorm", RMSNorm(hidden, eps=eps)),
            mixers=[MixerPart("linear_attn", _gdn(config, ops, tp))],
            ffn_norm=("post_attention_layernorm", RMSNorm(hidden, eps=eps)),
            ffns=[("mlp", mlp)],
        )
    return DecoderLayer(
        mixers=[MixerPart("self_attn", _attention(config, ops, tp))],
        post_norm=("post_attention_layernorm", RMSNorm(hidden, eps=eps)),
        ffns=[("mlp", mlp)],
        ffn_post_norm=("post_feedforward_layernorm", RMSNorm(hidden, eps=eps)),
    )


class OlmoHybridForCausalLM(CausalLM):
    """OLMo Hybrid language model: pre-norm GDN layers and post-norm attention layers."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu)")
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[_layer(config, kind, ops, tp) for kind in layer_types(config)],
            norm_eps=config.rms_norm_eps,
        )  # fmt: skip
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        self._conv_sizes = [key_dim, key_dim, value_dim]  # the q, k, v convs' channels
        self._conv_pieces: dict[str, dict[str, torch.Tensor]] = {}  # layer prefix -> q/k/v

    def expand_weight(self, name: str, tensor: Any) -> list[tuple[str, Any]]:
        """A GDN conv piece is held until its layer's three are read, then the three are
        returned cut at the real sizes (see the module docstring)."""
        match = _CONV_PIECE.fullmatch(name)
        if match is None:
            return [(name, tensor)]
        prefix, which = match.groups()
        pieces = self._conv_pieces.setdefault(prefix, {})
        pieces[which] = tensor if isinstance(tensor, torch.Tensor) else tensor[...]
        if len(pieces) < 3:
            return []
        del self._conv_pieces[prefix]
        parts = [pieces[w] for w in "qkv"]
        whole = torch.cat(parts)  # (CD, 1, K): [q | k | v]
        if len(whole) == sum(self._conv_sizes):  # else returned as read, for the loader to name
            parts = whole.split(self._conv_sizes)
        return [(f"{prefix}{w}_conv1d.weight", part) for w, part in zip("qkv", parts)]

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """The checkpoint's `attention_layer_norm` / `feedforward_layer_norm` onto this model's
        `input_layernorm` / `post_attention_layernorm`."""
        for old, new in _NORM_NAMES.items():
            if old in name:
                return name.replace(old, new)
        return name
