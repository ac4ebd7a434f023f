"""Nemotron-H (`NemotronHForCausalLM`: `nvidia/NVIDIA-Nemotron-Nano-9B-v2`, `-12B-v2`,
`nvidia/Nemotron-H-8B-Base-8K`, and the MoE `Nemotron-3-Nano-30B-A3B`).

Every layer is one mixer between a pre-norm and a residual: the `hybrid_override_pattern`
(transformers' `layers_block_type`) names each: `M` Mamba2, `*` attention (no position
embedding, no biases), `-` MLP `down(relu(up(x))^2)`, `E` MoE.

- The MoE router is DeepSeek-V3's (`layers.moe`'s `sigmoid_grouped`: `gate.weight`,
  `gate.e_score_correction_bias`, `n_group`, `topk_group`, `norm_topk_prob`,
  `routed_scaling_factor`). Experts are squared-ReLU MLPs (optionally in a latent space:
  `fc1_latent_proj`, `fc2_latent_proj`), accumulated in float32; `shared_experts` is added.
- The Mamba2 layers clamp the time step below at `time_step_min` in prefill and not in decode,
  as transformers does; a one-token chunk of a chunked prefill runs as a decode (as in vLLM),
  so where the clamp binds, chunked prefill may differ from whole prefill in the last digits.

Names are the checkpoints' (`backbone.embeddings`, `backbone.layers.N.norm`,
`backbone.layers.N.mixer.*`, `backbone.norm_f`, `lm_head`; transformers' `model.` prefix is
accepted too).

The multi-token prediction head of Nemotron 3 checkpoints (`mtp.*`, `num_nextn_predict_layers`
1) is skipped unless speculative method `mtp` asks for it (`models.mtp`). As vLLM's
`NemotronHMultiTokenPredictor`, one draft runs the blocks of `mtp_layers_block_type` (the
releases': attention then MoE, `mtp.layers.0`, `mtp.layers.1`) in order:

    x = eh_proj(cat([enorm(embed(next_token)), hnorm(hidden)]))   # mtp.layers.0.{enorm,...}
    x = x + mixer_i(norm_i(x))  for each block i                  # mtp.layers.i.{norm,mixer}
    out = final_layernorm(x)                                      # the last block's
    logits = lm_head(out)                                         # the target's, shared

with plain RMSNorms, `hidden` the target's output after `norm_f`, the embedding the target's.
The head's first and last norms and its projection load as `MultiTokenPredictor`'s
`pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc` and `norm`.

NVIDIA-Nemotron-Nano-9B-v2: 56 layers of hidden size 4480 (4 attention with 40 query and 8
key/value heads of 128, 28 MLP of 15680, 24 Mamba2 with 128 heads of 80, 8 groups, d_state 128,
conv 4).

Glossary: T tokens in the step, H hidden size, E experts, k experts per token, F expert size,
L latent size.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.mamba2_mixer import Mamba2Mixer
from vllm_mamba.layers.mlp import MLP
from vllm_mamba.layers.moe import ExpertList, ExpertRouter, RouterConfig, SparseMoE
from vllm_mamba.layers.self_attention import SelfAttention
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.mamba2_args import attention_head_dim, check_silu
from vllm_mamba.models.mtp import MTP_PREFIX, SupportsMTP
from vllm_mamba.ops.table import MambaOps

_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_NAMES = {"linear_attention": "mamba", "full_attention": "attention"}
# The MTP head's own tensors under the first / last block, onto `MultiTokenPredictor`'s names.
_MTP_NAMES = (
    (re.compile(r"^mtp\.layers\.\d+\.enorm\."), "mtp.pre_fc_norm_embedding."),
    (re.compile(r"^mtp\.layers\.\d+\.hnorm\."), "mtp.pre_fc_norm_hidden."),
    (re.compile(r"^mtp\.layers\.\d+\.eh_proj\."), "mtp.fc."),
    (re.compile(r"^mtp\.layers\.\d+\.final_layernorm\."), "mtp.norm."),
)
NAMES = StackNames(prefix="backbone", embeddings="embeddings", final_norm="norm_f")


def block_types(config: Any) -> list[str]:
    """Each layer's kind: `mamba`, `attention`, `mlp` or `moe`."""
    types = getattr(config, "layers_block_type", None)
    if not types:
        pattern = getattr(config, "hybrid_override_pattern", "") or ""
        if set(pattern) - set(_PATTERN):
            raise ValueError(f"hybrid_override_pattern {pattern!r}: only M, *, - and E")
        types = [_PATTERN[c] for c in pattern]
    types = [_NAMES.get(t, t) for t in types]
    unknown = sorted(set(types) - set(_PATTERN.values()))
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported (mamba, attention, mlp, moe)")
    return types


def mamba2_args(config: Any) -> dict[str, Any]:
    """`Mamba2Mixer` arguments from Nemotron-H's config names (the time step clamped below)."""
    return dict(
        hidden_size=config.hidden_size,
        num_heads=config.mamba_num_heads,
        head_dim=config.mamba_head_dim,
        n_groups=config.n_groups,
        state_size=config.ssm_state_size,
        conv_kernel=config.conv_kernel,
        chunk_size=config.chunk_size,
        time_step_limit=(float(config.time_step_min), float("inf")),
        use_bias=config.use_bias,
        use_conv_bias=config.use_conv_bias,
        norm_eps=config.layer_norm_epsilon,
    )


def _moe(config: Any, ops: MambaOps, tp: TensorParallel) -> SparseMoE:
    """Routed squared-ReLU experts (in the latent space when configured) plus shared ones."""
    hidden, bias = config.hidden_size, config.mlp_bias
    latent = getattr(config, "moe_latent_size", None)
    inner = latent or hidden
    route = RouterConfig(
        "sigmoid_grouped", config.n_routed_experts, config.num_experts_per_tok,
        renormalize=bool(config.norm_topk_prob), n_group=config.n_group,
        topk_group=config.topk_group, scaling=float(config.routed_scaling_factor),
        score_bias=True,
    )  # fmt: skip
    experts = ExpertList(
        MLP(inner, config.moe_intermediate_size, False, ops, tp, reduce=False)
        for _ in range(config.n_routed_experts)
    )
    shared = MLP(hidden, config.moe_shared_expert_intermediate_size, bias, ops, tp)
    projections = None
    if latent:
        projections = (Linear(hidden, latent, bias, ops), Linear(latent, hidden, bias, ops))
    return SparseMoE(
        ExpertRouter(hidden, route, ops), experts, tp, accumulate_fp32=True, shared=shared,
        latent=projections, names=("gate", "experts", "shared_experts"),
    )  # fmt: skip


def _layer(config: Any, kind: str, ops: MambaOps, tp: TensorParallel) -> nn.Module:
    """`x + mixer(norm(x))`, the mixer one of Mamba2, attention, MLP or MoE."""
    norm = ("norm", RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon))
    if kind == "mamba":
        mixer: nn.Module = Mamba2Mixer(**mamba2_args(config), ops=ops, tp=tp)
    elif kind == "attention":
        head_dim = attention_head_dim(config)
        mixer = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            head_dim, bias=False, scale=head_dim**-0.5, rotary=None, ops=ops, tp=tp,
        )  # fmt: skip
    elif kind == "mlp":
        ffn = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias, ops, tp)
        return DecoderLayer(ffn_norm=norm, ffns=[("mixer", ffn)])
    else:
        return DecoderLayer(ffn_norm=norm, ffns=[("mixer", _moe(config, ops, tp))])
    return DecoderLayer(norm=norm, mixers=[MixerPart("mixer", mixer)])


class NemotronHForCausalLM(SupportsMTP, CausalLM):
    """Nemotron-H language model: Mamba2, attention, MLP and MoE blocks by pattern; the MTP
    head on request (`enable_mtp`).

    Never ties: transformers keeps Nemotron-H's `lm_head` apart from the embeddings even when
    the config says `tie_word_embeddings` (the checkpoints carry both).
    """

    ties_word_embeddings = False
    skipped_weights: ClassVar[dict[str, str]] = {
        MTP_PREFIX: "the multi-token prediction head (Nemotron 3's; run by speculative method "
        "'mtp')"
    }

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        check_silu(config, "mamba_hidden_act")
        act = getattr(config, "mlp_hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"mlp_hidden_act {act!r} is not supported (relu2)")
        if config.mamba_num_heads % config.n_groups:
            raise ValueError("mamba_num_heads must be a multiple of n_groups")
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[_layer(config, kind, ops, tp) for kind in block_types(config)],
            norm_eps=config.layer_norm_epsilon,
        )  # fmt: skip

    def mtp_head_layers(self, count: int, ops: MambaOps, tp: TensorParallel) -> list[nn.Module]:
        """The blocks of one MTP step (`mtp_layers_block_type`).

        Raises:
            ValueError: more than one MTP layer, or a Mamba2 block in the pattern (the
                releases have one layer of attention and MoE blocks, as vLLM requires).
        """
        if count != 1:
            raise ValueError(f"num_nextn_predict_layers {count}: Nemotron-H's MTP has one layer")
        config = self.config  # type: ignore[attr-defined]
        kinds = [_NAMES.get(t, t) for t in (config.mtp_layers_block_type or [])]
        if not kinds or not set(kinds) <= {"attention", "mlp", "moe"}:
            raise ValueError(
                f"mtp_layers_block_type {config.mtp_layers_block_type}: the MTP blocks must be "
                "full_attention, mlp or moe"
            )
        return [_layer(config, kind, ops, tp) for kind in kinds]

    def mtp_head_options(self) -> dict[str, Any]:
        """Plain RMSNorms of `layer_norm_epsilon`; every block per draft."""
        eps = self.config.layer_norm_epsilon  # type: ignore[attr-defined]
        return {"norm_cls": RMSNorm, "eps": eps, "chain": True}

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """transformers' `model.` prefix is the checkpoints' `backbone.`; the MTP head's
        `enorm`, `hnorm`, `eh_proj` and `final_layernorm` are `MultiTokenPredictor`'s."""
        if name.startswith(MTP_PREFIX):
            for pattern, repl in _MTP_NAMES:
                name = pattern.sub(repl, name, count=1)
            return name
        return "backbone." + name[len("model.") :] if name.startswith("model.") else name
