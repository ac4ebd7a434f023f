"""Liquid LFM3 (`Lfm3ForCausalLM`: `LiquidAI/LFM3-1.7B`).

LFM2's short-conv and attention layers (`models.lfm2`), with three kinds named by
`layer_types` (`conv`, `sliding_attention`, `full_attention`) and, per config flag, norms on
both stages' outputs (`use_sandwich_norm`: `post_operator_norm`, `post_ffn_norm`, plain
RMSNorms of `norm_eps`):

    h = h + post_operator_norm(mixer(operator_norm(h)))     # mixer: `conv` or `self_attn`
    h = h + post_ffn_norm(feed_forward(ffn_norm(h)))

The final norm is `embedding_norm`; the head is tied to the embedding unless the config says
otherwise.

- Short-conv layers (`conv.*`): LFM2's, of width `conv_L_cache` (7 in LFM3-1.7B).
- Attention layers (`self_attn.*`): `q_proj`, `k_proj`, `v_proj`, `o_proj`, RMSNorms per head
  of the queries and keys (`q_norm`, `k_norm`) before RoPE, GQA, softmax scale `D ** -0.5`, no
  biases. `sliding_attention` layers read the last `sliding_window` keys (transformers'
  `kv_idx > q_idx - sliding_window`), `full_attention` layers all of them. With
  `use_attention_gate` each head's output is scaled by `sigmoid(g_proj(x))`, one gate per head
  from the layer's normed input, before `o_proj` (`SelfAttention`'s `head_gate`).
- RoPE per layer kind (`rope_parameters[kind]`), always over whole heads in NeoX pairs:
  `default` (sliding layers: base 1e4) or `proportional` (full layers: base 1e6, factor 0.5):
  the first `int(partial_rotary_factor * D // 2)` of the `D / 2` pairs rotate at
  `base ** (-2i / D)` (the exponent over the whole head, not the rotated part), divided by
  `factor` (default 1); the other pairs have frequency zero, so pass through.
- Feed-forward (`feed_forward.*`): a SwiGLU `w2(silu(w1(x)) * w3(x))` of `intermediate_size`
  (no width adjustment); no MoE in this family.

Checkpoint names -> this model's (`remap_weight_name`): LFM2's SwiGLU names (`w1`, `w3`, `w2`
-> `gate_proj`, `up_proj`, `down_proj`), and the attention gate, which the released checkpoints
(and transformers' `save_pretrained`) name `self_attn.gate_proj`, is `g_proj` as transformers
holds it. LFM3-1.7B: 24 layers of hidden size 2048 (sliding at 4, 8, ..., 20 with a window of
256, full at 2, 6, ..., 22: 16 query and 4 KV heads of 128), SwiGLU 7680, vocabulary 128000.

Tensor parallelism (`tp`): as LFM2 (short convs by channels, attention by heads with each
rank's gates, the MLPs column- then row-parallel, vocabulary-parallel embedding and head).

Glossary: T tokens in the step, H hidden size, Hq query heads, D head dim.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.rope_scaling import RopeFrequencies, plain_frequencies
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.layers.self_attention import SelfAttention
from vllm_mamba.layers.short_conv import ShortConv
from vllm_mamba.models.causal_lm import CausalLM
from vllm_mamba.models.layer_types import layer_types
from vllm_mamba.models.lfm2 import NAMES, Lfm2ForCausalLM
from vllm_mamba.ops.table import MambaOps

KINDS = ("conv", "sliding_attention", "full_attention")
_GATE_RENAMED = (".self_attn.gate_proj.", ".self_attn.g_proj.")


def proportional_frequencies(params: dict[str, Any], head_dim: int) -> RopeFrequencies:
    """`proportional` RoPE's `(D/2,)` inverse frequencies (see the module docstring)."""
    pairs = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    plain = plain_frequencies(float(params["rope_theta"]), head_dim).inv_freq  # (D/2,)
    still = torch.zeros(head_dim // 2 - pairs, device="cpu")  # (on the CPU even under `meta`)
    inv_freq = torch.cat([plain[:pairs], still])
    return RopeFrequencies(inv_freq / float(params.get("factor", 1.0)))


def _rotary(config: Any, kind: str, head_dim: int) -> RotaryEmbedding:
    """Layer kind `kind`'s RoPE over whole heads, from `rope_parameters[kind]`."""
    params = dict(config.rope_parameters[kind])
    if params.get("rope_type", "default") == "proportional":
        freqs = proportional_frequencies(params, head_dim)
        return RotaryEmbedding(head_dim, head_dim, config.max_position_embeddings, freqs)
    view = SimpleNamespace(
        rope_parameters=params, max_position_embeddings=config.max_position_embeddings
    )
    return RotaryEmbedding.from_config(view, head_dim, rot_dim=head_dim)


def _attention(config: Any, kind: str, ops: MambaOps, tp: TensorParallel) -> SelfAttention:
    """Attention with per-head q/k RMSNorms, the kind's RoPE and window, and the head gate."""
    heads, eps = config.num_attention_heads, config.norm_eps
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    window = config.sliding_window if kind == "sliding_attention" else None
    return SelfAttention(
        config.hidden_size, heads, config.num_key_value_heads, head_dim,
        bias=config.attention_bias, scale=head_dim**-0.5, rotary=_rotary(config, kind, head_dim),
        ops=ops, q_norm=RMSNorm(head_dim, eps), k_norm=RMSNorm(head_dim, eps),
        sliding_window=window, head_gate=bool(config.use_attention_gate), tp=tp,
    )  # fmt: skip


def _layer(config: Any, kind: str, ops: MambaOps, tp: TensorParallel) -> DecoderLayer:
    """Norm, short conv or attention, (post-norm,) residual; norm, SwiGLU, (post-norm,)
    residual."""
    hidden, eps = config.hidden_size, config.norm_eps
    if kind == "conv":
        conv = ShortConv(hidden, hidden, config.conv_L_cache, config.conv_bias, ops, tp)
        mixer = MixerPart("conv", conv)
    else:
        mixer = MixerPart("self_attn", _attention(config, kind, ops, tp))
    sandwich = bool(config.use_sandwich_norm)
    return DecoderLayer(
        norm=("operator_norm", RMSNorm(hidden, eps=eps)),
        mixers=[mixer],
        post_norm=("post_operator_norm", RMSNorm(hidden, eps=eps)) if sandwich else None,
        ffn_norm=("ffn_norm", RMSNorm(hidden, eps=eps)),
        ffns=[("feed_forward", GatedMLP(hidden, config.intermediate_size, False, ops, tp))],
        ffn_post_norm=("post_ffn_norm", RMSNorm(hidden, eps=eps)) if sandwich else None,
    )


class Lfm3ForCausalLM(CausalLM):
    """LFM3: short-conv, sliding- and full-attention layers, dense SwiGLU feed-forwards."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        kinds = layer_types(config, KINDS)
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[_layer(config, kind, ops, tp) for kind in kinds],
            norm_eps=config.norm_eps,
        )  # fmt: skip

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """LFM2's SwiGLU names and the checkpoint's attention gate (`gate_proj` -> `g_proj`)
        onto this model's (see the module docstring)."""
        return Lfm2ForCausalLM.remap_weight_name(name).replace(*_GATE_RENAMED)
