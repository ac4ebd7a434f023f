"""Qwen3-Next (`Qwen3NextForCausalLM`: `Qwen/Qwen3-Next-80B-A3B-Instruct` / `-Thinking`).

Qwen3.5's layer plan (`models.qwen3_5`) with its own GDN projection layout and a sparse MoE:
Gated DeltaNet and gated-attention layers by `layer_types` (`linear_attention` /
`full_attention`, attention every 4th layer in the releases), each pre-norm twice
(`input_layernorm`, `post_attention_layernorm`, zero-centred RMSNorms scaled by `1 + w`, as is
the final `norm`) with plain residuals.

- GDN layers (`linear_attn.*`): `in_proj_qkvz` and `in_proj_ba`, whose rows are interleaved per
  key-head group (`layers.gated_deltanet.Qwen3NextGatedDeltaNet` reorders them once after
  loading), `conv1d`, `A_log`, `dt_bias`, `norm`, `out_proj`.
- Attention layers (`self_attn.*`): Qwen3.5's gated attention (queries and a sigmoid output
  gate from one doubled `q_proj`, zero-centred q/k norms per head, GQA, RoPE on the first
  `partial_rotary_factor` (0.25) of each head).
- Feed-forward (`mlp.*`): the MoE on layer `i` when `num_experts > 0`, `(i + 1)` is a multiple
  of `decoder_sparse_step` and `i` is not in `mlp_only_layers`; a dense SwiGLU MLP of
  `intermediate_size` otherwise. The MoE is a router `gate` (softmax in float32, top-k,
  renormalised when `norm_topk_prob`), experts `experts.E.{gate,up,down}_proj` (the layout
  transformers saves) and a shared expert `shared_expert` scaled by
  `sigmoid(shared_expert_gate(x))`.

The checkpoints ship a multi-token prediction head (`mtp.*`), skipped at load time unless asked
for (speculative method `mtp`: `enable_mtp`, `vllm_mamba.models.mtp`); it is then built as
one more gated-attention layer whose feed-forward follows layer `i`'s rule at its index (the
MoE in the releases). The releases' config names no MTP depth; one layer, as vLLM assumes.
Qwen3-Next-80B-A3B: 48 layers of hidden size 2048; attention 16 query and 2 KV heads of 256;
GDN 16 key heads of 128 to 32 value heads of 128; 512 experts of 512, top-10, a shared expert
of 512; vocabulary 151936.

Tensor parallelism (`tp`): GDN by key-head groups (with their value heads), attention by heads,
every expert and MLP column- then row-parallel; the router and the shared-expert gate
replicated; vocabulary-parallel embedding and head.

Glossary: E experts, k experts per token, Hk / Hv GDN key / value heads.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import MixerPart
from vllm_mamba.layers.gated_deltanet import Qwen3NextGatedDeltaNet
from vllm_mamba.layers.layernorm import ZeroCenteredRMSNorm
from vllm_mamba.models.causal_lm import CausalLM
from vllm_mamba.models.layer_types import layer_types
from vllm_mamba.models.mtp import SupportsMTP
from vllm_mamba.models.qwen3_5 import NAMES, decoder_layer, gated_attention
from vllm_mamba.ops.table import MambaOps


def is_moe_layer(config: Any, index: int) -> bool:
    """Whether layer `index` has the MoE (else the dense MLP), as transformers decides."""
    sparse_step = config.decoder_sparse_step
    return (
        index not in (config.mlp_only_layers or ())
        and config.num_experts > 0
        and (index + 1) % sparse_step == 0
    )


def _layer(config: Any, index: int, kind: str, ops: MambaOps, tp: TensorParallel) -> nn.Module:
    """Norm, GDN (Qwen3-Next layout) or gated attention, residual; norm, MoE or MLP, residual."""
    if kind == "linear_attention":
        gdn = Qwen3NextGatedDeltaNet(
            config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
            config.linear_key_head_dim, config.linear_value_head_dim,
            config.linear_conv_kernel_dim, config.rms_norm_eps, ops, tp,
        )  # fmt: skip
        mixer = MixerPart("linear_attn", gdn)
    else:
        mixer = MixerPart("self_attn", gated_attention(config, ops, tp))
    return decoder_layer(config, mixer, is_moe_layer(config, index), ops, tp)


class Qwen3NextForCausalLM(SupportsMTP, CausalLM):
    """Qwen3-Next language model: GDN and gated-attention layers, MoE or dense MLPs; the MTP
    head on request (`enable_mtp`)."""

    skipped_weights: ClassVar[dict[str, str]] = {"mtp.": "the multi-token prediction head"}
    mtp_default_layers: ClassVar[int | None] = 1

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu)")
        if config.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {config.decoder_sparse_step}")
        kinds = layer_types(config)
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[_layer(config, i, kind, ops, tp) for i, kind in enumerate(kinds)],
            norm_eps=config.rms_norm_eps, final_norm_cls=ZeroCenteredRMSNorm,
        )  # fmt: skip

    def mtp_layer(self, index: int, ops: MambaOps, tp: TensorParallel) -> nn.Module:
        """MTP layer `index`: gated attention; the MoE or MLP of layer `index`'s rule (vLLM
        reads the layer index off `mtp.layers.{index}`)."""
        return _layer(self.config, index, "full_attention", ops, tp)
