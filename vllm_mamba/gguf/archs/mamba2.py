"""GGUF `mamba2` (llama.cpp's `Mamba2Model`) back to `Mamba2ForCausalLM`.

Metadata: `mamba2.embedding_length` -> hidden_size, `block_count`, `ssm.conv_kernel`,
`ssm.inner_size` (= num_heads * head_dim; expand = inner / hidden), `ssm.state_size`,
`ssm.time_step_rank` -> num_heads (the converter writes inner / head_dim there),
`ssm.group_count` -> n_groups, `attention.layer_norm_rms_epsilon` (also the gated norm's).
Not in the file: `chunk_size` (the SSD chunk length: the default 256, which changes no result
beyond float rounding) and `time_step_limit` (the default (0, inf)).

Tensors as Mamba's (`vllm_mamba.gguf.archs.mamba`), and: `ssm_a (H, 1)` (`-exp(A_log)`) ->
`mixer.A_log (H,)`, `ssm_d (H, 1)` -> `mixer.D (H,)`, `ssm_dt.bias` -> `mixer.dt_bias`,
`ssm_norm.weight (G, I / G)` -> `mixer.norm.weight (I,)`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.gguf.arch import GGUFArchitecture, register_gguf_architecture
from vllm_mamba.gguf.archs.mamba import a_log, mamba_tensors, stack_tensor
from vllm_mamba.gguf.metadata import arch_value, decimal, has_tensor, special_token_ids

__all__ = ["mamba2_config", "mamba2_tensors"]

_BLOCK = re.compile(r"^blk\.(\d+)\.(ssm_a|ssm_d|ssm_norm\.weight|ssm_dt\.bias)$")


def mamba2_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """The `Mamba2ForCausalLM` `config.json` of a GGUF `mamba2` file."""
    hidden = int(arch_value(metadata, "embedding_length"))
    inner = int(arch_value(metadata, "ssm.inner_size"))
    heads = int(arch_value(metadata, "ssm.time_step_rank"))
    if heads <= 0 or inner % heads:
        raise ValueError(f"GGUF mamba2: ssm.time_step_rank {heads} must divide inner_size {inner}")
    return {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "hidden_size": hidden,
        "num_hidden_layers": int(arch_value(metadata, "block_count")),
        "state_size": int(arch_value(metadata, "ssm.state_size")),
        "conv_kernel": int(arch_value(metadata, "ssm.conv_kernel")),
        "expand": inner / hidden if inner % hidden else inner // hidden,
        "num_heads": heads,
        "head_dim": inner // heads,
        "n_groups": int(arch_value(metadata, "ssm.group_count", 1)),
        "use_bias": has_tensor(metadata, "blk.0.ssm_in.bias"),
        "use_conv_bias": has_tensor(metadata, "blk.0.ssm_conv1d.bias"),
        "layer_norm_epsilon": decimal(arch_value(metadata, "attention.layer_norm_rms_epsilon")),
        "residual_in_fp32": True,
        **special_token_ids(metadata),
    }


def mamba2_tensors(
    name: str, tensor: torch.Tensor, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensor of one GGUF `mamba2` tensor (see the module docstring)."""
    if stack_tensor(name, tensor) is not None:
        yield from mamba_tensors(name, tensor, config)
        return
    m = _BLOCK.match(name)
    if m is None:
        yield from mamba_tensors(name, tensor, config)
        return
    prefix = f"backbone.layers.{m[1]}.mixer."
    part = m[2]
    if part == "ssm_a":
        yield prefix + "A_log", a_log(tensor.reshape(-1))
    elif part == "ssm_d":
        yield prefix + "D", tensor.reshape(-1)
    elif part == "ssm_dt.bias":
        yield prefix + "dt_bias", tensor
    else:
        yield prefix + "norm.weight", tensor.reshape(-1)


register_gguf_architecture(GGUFArchitecture("mamba2", mamba2_config, mamba2_tensors))
