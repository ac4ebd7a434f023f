"""vllm_mamba_ema: an out-of-tree vllm_mamba plugin with a toy recurrent layer of its own.

`register()` makes `EmaForCausalLM` (config `model_type="ema_lm"`) loadable by `vllm_mamba.LLM`;
`write_tiny_checkpoint` saves a seeded random model to try it on; `EmaReference` is the
independent full-sequence implementation it is checked against.
"""

from __future__ import annotations

from vllm_mamba_ema.checkpoint import write_tiny_checkpoint
from vllm_mamba_ema.configuration import EmaConfig
from vllm_mamba_ema.reference import EmaReference

__all__ = ["EmaConfig", "EmaReference", "register", "write_tiny_checkpoint"]


def register() -> None:
    """Registers the config with `AutoConfig` and the model with the engine (idempotent)."""
    from transformers import AutoConfig

    from vllm_mamba import ModelRegistry

    AutoConfig.register(EmaConfig.model_type, EmaConfig, exist_ok=True)
    ModelRegistry.register_model("EmaForCausalLM", "vllm_mamba_ema.model:EmaForCausalLM")
