"""Lara-4-Mini (`LaraMiniForCausalLM`: `translated/Lara-4-Mini-Base`).

Gated DeltaNet, sliding-window attention and full attention layers by `layer_types`
(`linear_attention` / `sliding_attention` / `full_attention`; the releases repeat `[GDN,
sliding, GDN, full, sliding]`). Every layer is pre-norm twice with plain RMSNorms
(`weight * x / rms(x)`, `rms_norm_eps`, as is the final `norm`), plain residuals and the MoE:

    h = h + mixer(input_layernorm(h))              # mixer: `linear_attn` or `self_attn`
    h = h + mlp(post_attention_layernorm(h))

- GDN layers (`linear_attn.*`): Qwen3.5's mixer (`layers.gated_deltanet.Qwen3_5GatedDeltaNet`:
  depthwise conv without bias, L2-normed q and k, `beta = sigmoid(b)`, a per-head gated RMSNorm
  of the output). The checkpoints fuse its input projections into one `in_proj` whose rows are
  `[q | k | v | z | b | a]`, which `expand_weight` splits into `in_proj_qkv`, `in_proj_z`,
  `in_proj_b` and `in_proj_a` (as transformers does on load); their gated norm `out_norm` is
  this model's `norm` (`remap_weight_name`).
- Attention layers (`self_attn.*`): `q_proj`, `k_proj`, `v_proj`, `o_proj` (biases when
  `attention_bias`), RMSNorms per head of the queries and keys (`q_norm`, `k_norm`), GQA,
  softmax scale `D ** -0.5`. The sliding layers rotate queries and keys (RoPE over whole heads)
  and read the last `sliding_window` positions (transformers' `kv_idx > q_idx - W`); the full
  layers read every position and have no position embedding.
- Feed-forward (`mlp.*`), on every layer: a router `gate` (softmax of float32 logits, top-k,
  renormalised when `norm_topk_prob`), experts of `moe_intermediate_size` (transformers' fused
  `experts.gate_up_proj (E, 2F, H)` and `experts.down_proj (E, H, F)`, split one by one as
  Qwen3.5's) and a shared SwiGLU expert `shared_expert` of `shared_expert_intermediate_size`,
  added without a gate.

Lara-4-Mini: 34 layers of hidden size 1024; attention 16 query and 4 KV heads of 128, window
512; GDN 8 key heads to 16 value heads of 128; 128 experts of 512, top-4, a shared expert of
512; vocabulary 151936, tied head.

Tensor parallelism (`tp`): GDN by key heads and their value heads, attention by heads, every
expert and the shared expert column- then row-parallel; the router replicated;
vocabulary-parallel embedding and head.

Glossary: H hidden size, D head dim, E experts, F expert width, Hk / Hv GDN key / value heads,
Dk / Dv their head dims.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.gated_deltanet import Qwen3_5GatedDeltaNet
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.moe import ExpertList, ExpertRouter, RouterConfig, SparseMoE
from vllm_mamba.layers.packed_weights import rows_of
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.layers.self_attention import SelfAttention
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.layer_types import layer_types
from vllm_mamba.models.qwen3_5 import Qwen3_5ForCausalLM
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="norm")
KINDS = ("linear_attention", "sliding_attention", "full_attention")
# The GDN's projections, in the order of their rows in the checkpoints' fused `in_proj`.
IN_PROJ_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def _gdn(config: Any, ops: MambaOps, tp: TensorParallel) -> Qwen3_5GatedDeltaNet:
    return Qwen3_5GatedDeltaNet(
        config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
        config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim,
        config.rms_norm_eps, ops, tp,
    )  # fmt: skip


def _attention(config: Any, sliding: bool, ops: MambaOps, tp: TensorParallel) -> SelfAttention:
    """Attention with RMSNorms per head of the queries and keys; RoPE and the window on the
    sliding layers only."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    eps = config.rms_norm_eps
    rotary = RotaryEmbedding.from_config(config, head_dim, rot_dim=head_dim) if sliding else None
    return SelfAttention(
        config.hidden_size, heads, config.num_key_value_heads, head_dim,
        bias=config.attention_bias, scale=head_dim**-0.5, rotary=rotary, ops=ops,
        q_norm=RMSNorm(head_dim, eps=eps), k_norm=RMSNorm(head_dim, eps=eps),
        sliding_window=config.sliding_window if sliding else None, tp=tp,
    )  # fmt: skip


def _sparse_moe(config: Any, ops: MambaOps, tp: TensorParallel) -> SparseMoE:
    """Routed experts (softmax of float32 logits, top-k) plus the ungated shared expert."""
    hidden, num_experts = config.hidden_size, config.num_experts
    route = RouterConfig(
        "softmax_topk", num_experts, config.num_experts_per_tok,
        renormalize=bool(config.norm_topk_prob), float32_logits=True,
    )  # fmt: skip
    experts = ExpertList(
        GatedMLP(hidden, config.moe_intermediate_size, False, ops, tp, reduce=False)
        for _ in range(num_experts)
    )
    shared = GatedMLP(hidden, config.shared_expert_intermediate_size, False, ops, tp)
    return SparseMoE(
        ExpertRouter(hidden, route, ops), experts, tp, shared=shared,
        names=("gate", "experts", "shared_expert"),
    )  # fmt: skip


def _layer(config: Any, kind: str, ops: MambaOps, tp: TensorParallel) -> nn.Module:
    """Norm, GDN or attention, residual; norm, MoE, residual."""
    hidden, eps = config.hidden_size, config.rms_norm_eps
    if kind == "linear_attention":
        mixer = MixerPart("linear_attn", _gdn(config, ops, tp))
    else:
        mixer = MixerPart("self_attn", _attention(config, kind == "sliding_attention", ops, tp))
    return DecoderLayer(
        norm=("input_layernorm", RMSNorm(hidden, eps=eps)),
        mixers=[mixer],
        ffn_norm=("post_attention_layernorm", RMSNorm(hidden, eps=eps)),
        ffns=[("mlp", _sparse_moe(config, ops, tp))],
    )


class LaraMiniForCausalLM(CausalLM):
    """Lara-4-Mini language model: GDN, sliding-window and full attention layers, each with
    the MoE."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu)")
        if config.sliding_window is None or config.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {config.sliding_window}")
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[_layer(config, kind, ops, tp) for kind in layer_types(config, KINDS)],
            norm_eps=config.rms_norm_eps,
        )  # fmt: skip
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        heads = config.linear_num_value_heads
        self._in_proj_rows = [2 * key_dim + value_dim, value_dim, heads, heads]  # IN_PROJ_PARTS

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """The checkpoints' GDN `out_norm` onto this model's `norm`."""
        return name.replace(".linear_attn.out_norm.", ".linear_attn.norm.", 1)

    def expand_weight(self, name: str, tensor: Any) -> list[tuple[str, Any]]:
        """The GDN's fused `in_proj.weight` `(2 Hk Dk + 2 Hv Dv + 2 Hv, H)` as its four
        projections (a pre-quantised tensor keeps its rows' integer layout); fused experts one
        by one (Qwen3.5's)."""
        if not name.endswith(".linear_attn.in_proj.weight"):
            return Qwen3_5ForCausalLM.expand_weight(name, tensor)
        whole = tensor if isinstance(tensor, torch.Tensor) else tensor[...]
        if whole.dim() != 2 or whole.shape[0] != sum(self._in_proj_rows):
            return [(name, whole)]  # left for the loader to name as unexpected
        base = name[: -len("in_proj.weight")]
        parts, start = [], 0
        for part, rows in zip(IN_PROJ_PARTS, self._in_proj_rows):
            parts.append((f"{base}{part}.weight", rows_of(whole, slice(start, start + rows))))
            start += rows
        return parts
