"""GGUF `mamba` (Mamba1 and FalconMamba, as llama.cpp's `MambaModel` writes them) back to
`MambaForCausalLM` / `FalconMambaForCausalLM`.

Metadata: `mamba.embedding_length` -> hidden_size, `block_count`, `ssm.conv_kernel`,
`ssm.inner_size` -> intermediate_size (expand = inner / hidden), `ssm.state_size`,
`ssm.time_step_rank`, `attention.layer_norm_rms_epsilon`; `ssm.dt_b_c_rms` true means
FalconMamba (its dt / B / C norms use `mixer_rms_eps`, which the file does not keep: the
FalconMamba default 1e-6 of the released checkpoints). `use_bias` / `use_conv_bias` from the
presence of `ssm_in.bias` / `ssm_conv1d.bias`.

Tensors (`blk.N.` -> `backbone.layers.N.`): `token_embd` -> `backbone.embeddings`,
`output_norm` -> `backbone.norm_f`, `output` -> `lm_head`, `attn_norm` -> `norm`, `ssm_in`,
`ssm_x`, `ssm_dt`, `ssm_out` -> `mixer.{in,x,dt,out}_proj`; `ssm_conv1d.weight (D, K)` ->
`mixer.conv1d.weight (D, 1, K)`; `ssm_a` (`A = -exp(A_log)`, D x N) -> `mixer.A_log = log(-A)`
(computed in float64); `ssm_d` -> `mixer.D`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.gguf.arch import GGUFArchitecture, register_gguf_architecture
from vllm_mamba.gguf.metadata import arch_value, decimal, has_tensor, special_token_ids

__all__ = ["a_log", "mamba_config", "mamba_tensors", "stack_tensor"]

_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.?(weight|bias)?$")
_TOP = {
    "token_embd.weight": "backbone.embeddings.weight",
    "output_norm.weight": "backbone.norm_f.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "norm",
    "ssm_in": "mixer.in_proj",
    "ssm_x": "mixer.x_proj",
    "ssm_dt": "mixer.dt_proj",
    "ssm_out": "mixer.out_proj",
    "ssm_conv1d": "mixer.conv1d",
}


def a_log(a: torch.Tensor) -> torch.Tensor:
    """`A_log` from the stored `A = -exp(A_log)` (log taken in float64, back to float32)."""
    return torch.log(-a.double()).float()


def stack_tensor(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """The embeddings, final norm and head under the Mamba-family names, else None."""
    hf = _TOP.get(name)
    return None if hf is None else (hf, tensor)


def mamba_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """The Mamba / FalconMamba `config.json` of a GGUF `mamba` file."""
    hidden = int(arch_value(metadata, "embedding_length"))
    inner = int(arch_value(metadata, "ssm.inner_size"))
    falcon = bool(arch_value(metadata, "ssm.dt_b_c_rms", False))
    config = {
        "architectures": ["FalconMambaForCausalLM" if falcon else "MambaForCausalLM"],
        "model_type": "falcon_mamba" if falcon else "mamba",
        "hidden_size": hidden,
        "num_hidden_layers": int(arch_value(metadata, "block_count")),
        "state_size": int(arch_value(metadata, "ssm.state_size")),
        "conv_kernel": int(arch_value(metadata, "ssm.conv_kernel")),
        "intermediate_size": inner,
        "expand": inner // hidden,
        "time_step_rank": int(arch_value(metadata, "ssm.time_step_rank")),
        "use_bias": has_tensor(metadata, "blk.0.ssm_in.bias"),
        "use_conv_bias": has_tensor(metadata, "blk.0.ssm_conv1d.bias"),
        "layer_norm_epsilon": decimal(arch_value(metadata, "attention.layer_norm_rms_epsilon")),
        "residual_in_fp32": True,
        **special_token_ids(metadata),
    }
    if falcon:
        config["mixer_rms_eps"] = 1e-6
    return config


def mamba_tensors(
    name: str, tensor: torch.Tensor, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensor of one GGUF `mamba` tensor (see the module docstring).

    Raises:
        ValueError: a tensor name the mapping does not know.
    """
    top = stack_tensor(name, tensor)
    if top is not None:
        yield top
        return
    m = _BLOCK.match(name)
    if m is None:
        raise ValueError(f"GGUF mamba: unknown tensor {name}")
    layer, part, kind = m[1], m[2], m[3] or "weight"
    prefix = f"backbone.layers.{layer}."
    if part == "ssm_a":
        yield prefix + "mixer.A_log", a_log(tensor)
    elif part == "ssm_d":
        yield prefix + "mixer.D", tensor
    elif part == "ssm_conv1d" and kind == "weight":
        yield prefix + "mixer.conv1d.weight", tensor.unsqueeze(1)  # (D, K) -> (D, 1, K)
    elif part in _LAYER:
        yield f"{prefix}{_LAYER[part]}.{kind}", tensor
    else:
        raise ValueError(f"GGUF mamba: unknown tensor {name}")


register_gguf_architecture(GGUFArchitecture("mamba", mamba_config, mamba_tensors))
