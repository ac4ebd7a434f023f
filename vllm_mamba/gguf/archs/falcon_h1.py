"""GGUF `falcon-h1` back onto Falcon-H1 (`FalconH1ForCausalLM`).

llama.cpp's `FalconH1Model` (`conversion/falcon_h1.py`, a `Mamba2Model`) folds every muP
multiplier into the weights (embedding, head, MLP gate and down, attention q / k / v / o,
the Mamba2 in_proj and its z / x / B / C / dt segments, out_proj) and writes none of them:
the config here has them all 1.0 and takes the weights as they are (equal to the model's
products up to float32 rounding of the folding). Mamba2 tensors as `Mamba2Model` writes them
(`_common.mamba2_tensor`); attention is not permuted. Metadata: the SSD width
`ssm.inner_size` (`mamba_d_ssm`), heads `ssm.time_step_rank`; the gated norm when the file has
`ssm_norm`, applied after the gate (as llama.cpp's Mamba2 layer: `mamba_norm_before_gate`
false); biases from the tensors present; `mamba_chunk_size` the class default.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.gguf.arch import GGUFArchitecture, register_gguf_architecture
from vllm_mamba.gguf.archs._common import (
    LLAMA_GLOBALS,
    Metadata,
    Renamer,
    common_config,
    mamba2_tensor,
    split_block,
    tensor_names,
)

ARCH = "falcon-h1"
_GLOBALS = {**LLAMA_GLOBALS, "output_norm.weight": "model.final_layernorm.weight"}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm": "pre_ff_layernorm.weight",  # the converter's name has no `.weight`
    "ffn_norm.weight": "pre_ff_layernorm.weight",
}
for _part, _proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
    for _kind in ("weight", "bias"):
        _BLOCK[f"attn_{_part}.{_kind}"] = f"self_attn.{_proj}.{_kind}"
for _part in ("gate", "up", "down"):
    for _kind in ("weight", "bias"):
        _BLOCK[f"ffn_{_part}.{_kind}"] = f"feed_forward.{_part}_proj.{_kind}"
_RENAME = Renamer(ARCH, _GLOBALS, _BLOCK)


def _config(metadata: dict[str, Any]) -> dict[str, Any]:
    m = Metadata(metadata, ARCH)
    names = tensor_names(metadata)
    has = lambda suffix: any(x.endswith(suffix) for x in names)  # noqa: E731
    config = common_config(metadata, m)
    heads, inner = m.int("ssm.time_step_rank"), m.int("ssm.inner_size")
    config.update(
        architectures=["FalconH1ForCausalLM"],
        model_type="falcon_h1",
        intermediate_size=m.int("feed_forward_length"),
        num_attention_heads=m.int("attention.head_count"),
        num_key_value_heads=m.int("attention.head_count_kv"),
        head_dim=m.int("attention.key_length"),
        mamba_d_ssm=inner,
        mamba_n_heads=heads,
        mamba_d_head=inner // heads,
        mamba_n_groups=m.int("ssm.group_count"),
        mamba_d_state=m.int("ssm.state_size"),
        mamba_d_conv=m.int("ssm.conv_kernel"),
        mamba_rms_norm=has("ssm_norm.weight"),
        mamba_norm_before_gate=False,
        mamba_proj_bias=has("ssm_in.bias"),
        mamba_conv_bias=has("ssm_conv1d.bias"),
        attention_bias=has("attn_q.bias"),
        mlp_bias=has("ffn_up.bias"),
        projectors_bias=has("ssm_out.bias"),
        embedding_multiplier=1.0,
        lm_head_multiplier=1.0,
        mlp_multipliers=[1.0, 1.0],
        key_multiplier=1.0,
        attention_in_multiplier=1.0,
        attention_out_multiplier=1.0,
        ssm_in_multiplier=1.0,
        ssm_out_multiplier=1.0,
        ssm_multipliers=[1.0] * 5,
    )
    return config


def _tensors(
    name: str, tensor: torch.Tensor, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    bid, suffix = split_block(name)
    mamba = None if bid is None else mamba2_tensor(suffix, tensor, f"model.layers.{bid}.mamba.")
    yield mamba if mamba is not None else (_RENAME(name), tensor)


register_gguf_architecture(GGUFArchitecture(ARCH, _config, _tensors))
