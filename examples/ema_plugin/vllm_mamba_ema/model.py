"""`EmaForCausalLM`: the engine's model of the toy EMA LM, composed from the engine's parts.

Each layer is a `DecoderLayer`: `input_layernorm` -> `mixer` (`EmaMixer`) -> residual, then
`post_attention_layernorm` -> `mlp` (`GatedMLP`) -> residual; the container is
`model.embed_tokens`, `model.layers`, `model.norm`, plus `lm_head` (tied by default).
Attention-free, so the engine runs it with the placeholder backend and no KV cache.
"""

from __future__ import annotations

from typing import Any

from vllm_mamba.distributed.parallel_state import SINGLE
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.ops.table import MambaOps
from vllm_mamba_ema.mixer import EmaMixer


class EmaForCausalLM(CausalLM):
    """Token embedding, `num_hidden_layers` EMA decoder layers, final norm, LM head."""

    supports_tensor_parallel = False
    supports_quantization = False

    def __init__(self, config: Any, ops: MambaOps) -> None:
        H, eps = config.hidden_size, config.rms_norm_eps
        layers = [
            DecoderLayer(
                norm=("input_layernorm", RMSNorm(H, eps=eps)),
                mixers=[MixerPart("mixer", EmaMixer(H, config.ema_size, ops))],
                ffn_norm=("post_attention_layernorm", RMSNorm(H, eps=eps)),
                ffns=[("mlp", GatedMLP(H, config.intermediate_size, False, ops))],
            )
            for _ in range(config.num_hidden_layers)
        ]
        super().__init__(config, ops, SINGLE, names=StackNames(), layers=layers, norm_eps=eps)
