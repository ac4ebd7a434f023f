"""Mamba (`MambaForCausalLM`, the `state-spaces/mamba-*-hf` checkpoints) for the engine.

Module names match the Hugging Face checkpoints (`backbone.embeddings`, `backbone.layers.N.norm`,
`backbone.layers.N.mixer.*`, `backbone.norm_f`, `lm_head`), so loading is an identity mapping.
One forward runs over the step's flat token batch `(T,)`; the LM head runs separately, only on
the positions that are sampled.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mamba_mixer import MambaMixer
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.mamba2_args import check_silu
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="backbone", embeddings="embeddings", final_norm="norm_f")


class MambaForCausalLM(CausalLM):
    """Mamba language model: pre-norm residual blocks around one mixer each (`norm`, `mixer`);
    attention-free, so it runs with the placeholder backend. Subclasses with another mixer
    (Mamba2) override `make_mixer`, and variants of its mixer (FalconMamba) `mixer_args`."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        check_silu(config)
        eps = config.layer_norm_epsilon
        layers = [
            DecoderLayer(
                norm=("norm", RMSNorm(config.hidden_size, eps=eps)),
                mixers=[MixerPart("mixer", self.make_mixer(config, ops, tp))],
                residual_in_fp32=bool(config.residual_in_fp32),
            )
            for _ in range(config.num_hidden_layers)
        ]
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=layers, norm_eps=eps,
        )  # fmt: skip

    @classmethod
    def make_mixer(cls, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> nn.Module:
        """One layer's mixer (this rank's shard of it)."""
        return MambaMixer(**cls.mixer_args(config), ops=ops, tp=tp)

    @staticmethod
    def mixer_args(config: Any) -> dict[str, Any]:
        """`MambaMixer` arguments (without `ops` and `tp`) from the config."""
        return dict(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            state_size=config.state_size,
            conv_kernel=config.conv_kernel,
            time_step_rank=int(config.time_step_rank),
            use_bias=config.use_bias,
            use_conv_bias=config.use_conv_bias,
        )

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """Checkpoint name -> parameter name (older checkpoints say `embedding`)."""
        return name.replace("backbone.embedding.", "backbone.embeddings.")
