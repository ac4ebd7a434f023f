"""FalconMamba (`FalconMambaForCausalLM`, the `tiiuae/falcon-mamba-*` checkpoints).

FalconMamba is Mamba with one change in the mixer: the time step, B and C that `x_proj`
produces are each RMS-normalised (no weight, epsilon `mixer_rms_eps`) before the scan. The
checkpoints carry the same tensors as Mamba's, so the model is Mamba's with that option of
`MambaMixer` turned on; everything else (blocks, state shapes, loading) is shared.
"""

from __future__ import annotations

from typing import Any

from vllm_mamba.models.mamba import MambaForCausalLM


class FalconMambaForCausalLM(MambaForCausalLM):
    """FalconMamba language model: Mamba whose mixers normalise dt, B and C."""

    @staticmethod
    def mixer_args(config: Any) -> dict[str, Any]:
        """Mamba's mixer arguments, with `mixer_rms_eps` set."""
        return dict(MambaForCausalLM.mixer_args(config), mixer_rms_eps=config.mixer_rms_eps)
