"""Mamba2 (`Mamba2ForCausalLM`: `state-spaces/mamba2-*` converted to HF, Codestral Mamba).

Same layout as Mamba (`backbone.embeddings`, `backbone.layers.N.norm`, `backbone.layers.N.mixer.*`,
`backbone.norm_f`, `lm_head`) with the multi-head SSD mixer, whose per-slot state (its
`state_spec`) is conv `(I + 2 G N, K - 1)` and ssm `(NH, P, N)`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.mamba2_mixer import Mamba2Mixer
from vllm_mamba.models.mamba import MambaForCausalLM
from vllm_mamba.ops.table import MambaOps


def _check_config(config: Any) -> None:
    """Raises ValueError for configs whose shapes do not fit together."""
    intermediate = int(config.expand * config.hidden_size)
    if intermediate != config.num_heads * config.head_dim:
        raise ValueError(
            f"Mamba2 config: expand * hidden_size ({intermediate}) must equal "
            f"num_heads * head_dim ({config.num_heads * config.head_dim})"
        )
    if config.num_heads % config.n_groups:
        raise ValueError(
            f"Mamba2 config: num_heads ({config.num_heads}) must be a multiple of "
            f"n_groups ({config.n_groups})"
        )


class Mamba2ForCausalLM(MambaForCausalLM):
    """Mamba2 language model: Mamba's model with the multi-head SSD mixer."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        _check_config(config)
        super().__init__(config, ops, tp)

    @staticmethod
    def make_mixer(config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> nn.Module:
        """One layer's Mamba2 mixer (this rank's shard of it)."""
        return Mamba2Mixer(
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            head_dim=config.head_dim,
            n_groups=config.n_groups,
            state_size=config.state_size,
            conv_kernel=config.conv_kernel,
            chunk_size=config.chunk_size,
            time_step_limit=tuple(config.time_step_limit),
            use_bias=config.use_bias,
            use_conv_bias=config.use_conv_bias,
            norm_eps=config.layer_norm_epsilon,
            ops=ops,
            tp=tp,
        )
