"""FalconMamba (`FalconMambaForCausalLM`, the `tiiuae/falcon-mamba-*` checkpoints).

FalconMamba is Mamba with one change in the mixer: the time step, B and C that `x_proj`
produces are each RMS-normalised (no weight, epsilon `mixer_rms_eps`) before the scan. The
checkpoints carry the same tensors as Mamba's, so the model is Mamba's with that option of
`MambaMixer` turned on; everything else (blocks, state shapes, loading) is shared.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.mamba_mixer import MambaMixer
from vllm_mamba.models.mamba import MambaForCausalLM
from vllm_mamba.ops.table import MambaOps


class FalconMambaForCausalLM(MambaForCausalLM):
    """FalconMamba language model: Mamba whose mixers normalise dt, B and C."""

    @staticmethod
    def make_mixer(config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> nn.Module:
        """One layer's mixer: Mamba's, with `mixer_rms_eps` set."""
        return MambaMixer(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            state_size=config.state_size,
            conv_kernel=config.conv_kernel,
            time_step_rank=int(config.time_step_rank),
            use_bias=config.use_bias,
            use_conv_bias=config.use_conv_bias,
            ops=ops,
            mixer_rms_eps=config.mixer_rms_eps,
            tp=tp,
        )
