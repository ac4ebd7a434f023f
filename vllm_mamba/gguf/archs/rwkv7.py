"""GGUF `rwkv7` (llama.cpp's `Rwkv7Model`) back to `RWKV7ForCausalLM` in fla-hub's layout.

Metadata: `rwkv7.embedding_length` -> hidden_size, `block_count`, `wkv.head_size` -> head_dim,
`attention.{decay,iclr,value_residual_mix,gate}_lora_rank` -> `{decay,a,v,gate}_low_rank_dim`,
`feed_forward_length` -> intermediate_size, `attention.layer_norm_epsilon` -> norm_eps; the
group norm's epsilon is llama.cpp's (and BlinkDL's) fixed 64e-5.

Tensors (`blk.N.` -> `model.layers.N.`; C hidden size, H heads of N):

    token_embd -> model.embeddings    token_embd_norm -> layers.0.pre_norm
    output_norm -> model.norm         output -> lm_head
    attn_norm -> attn_norm            attn_norm_2 -> ffn_norm
    time_mix_lerp_fused (6, 1, 1, C) -> attn.x_{r,w,k,v,a,g} (1, 1, C) each (5 without a gate)
    time_mix_{w,a,v,g}1 (R, C) -> attn.*_lora.lora.0.weight; *2 (C, R) -> lora.2.weight;
    time_mix_{w,a,v}0 (C,) -> lora.2.bias
    time_mix_{k_k,k_a} -> attn.{k_k,k_a}; time_mix_r_k (H N,) -> attn.r_k (H, N)
    time_mix_{receptance,key,value,output} -> attn.{r,k,v,o}_proj; time_mix_ln -> attn.g_norm
    channel_mix_{key,value} -> ffn.{key,value}; channel_mix_lerp_k -> ffn.x_k

Layer 0's `time_mix_v0/1/2` (copies of `a0/1/2` the converter writes for llama.cpp; layer 0's
value is `v_first` itself) are dropped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.gguf.arch import GGUFArchitecture, register_gguf_architecture
from vllm_mamba.gguf.metadata import arch_value, decimal, has_tensor, special_token_ids

__all__ = ["rwkv7_config", "rwkv7_tensors"]

GROUP_NORM_EPS = 64e-5
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+?)\.(weight|bias)$")
_TOP = {
    "token_embd.weight": "model.embeddings.weight",
    "token_embd_norm.weight": "model.layers.0.pre_norm.weight",
    "token_embd_norm.bias": "model.layers.0.pre_norm.bias",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",
    "output.weight": "lm_head.weight",
}
_PARAMS = {  # bare parameters (no .weight)
    "time_mix_k_k": "attn.k_k",
    "time_mix_k_a": "attn.k_a",
    "channel_mix_lerp_k": "ffn.x_k",
}
_MODULES = {
    "attn_norm": "attn_norm",
    "attn_norm_2": "ffn_norm",
    "time_mix_receptance": "attn.r_proj",
    "time_mix_key": "attn.k_proj",
    "time_mix_value": "attn.v_proj",
    "time_mix_output": "attn.o_proj",
    "time_mix_ln": "attn.g_norm",
    "channel_mix_key": "ffn.key",
    "channel_mix_value": "ffn.value",
}
_LORA = re.compile(r"^time_mix_([wavg])([012])$")
_LORA_PART = {"1": "lora.0.weight", "2": "lora.2.weight", "0": "lora.2.bias"}
_LERP = ("r", "w", "k", "v", "a", "g")


def rwkv7_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """The fla-hub `RWKV7ForCausalLM` `config.json` of a GGUF `rwkv7` file."""
    hidden = int(arch_value(metadata, "embedding_length"))
    return {
        "architectures": ["RWKV7ForCausalLM"],
        "model_type": "rwkv7",
        "hidden_size": hidden,
        "num_hidden_layers": int(arch_value(metadata, "block_count")),
        "head_dim": int(arch_value(metadata, "wkv.head_size")),
        "decay_low_rank_dim": int(arch_value(metadata, "attention.decay_lora_rank")),
        "a_low_rank_dim": int(arch_value(metadata, "attention.iclr_lora_rank")),
        "v_low_rank_dim": int(arch_value(metadata, "attention.value_residual_mix_lora_rank")),
        "gate_low_rank_dim": int(arch_value(metadata, "attention.gate_lora_rank")),
        "intermediate_size": int(arch_value(metadata, "feed_forward_length")),
        "norm_eps": decimal(arch_value(metadata, "attention.layer_norm_epsilon")),
        "norm_bias": has_tensor(metadata, "blk.0.attn_norm.bias"),
        "norm_first": True,
        "hidden_act": "sqrelu",
        "group_norm_eps": GROUP_NORM_EPS,
        **{k: v for k, v in special_token_ids(metadata).items() if k != "pad_token_id"},
    }


def rwkv7_tensors(
    name: str, tensor: torch.Tensor, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of one GGUF `rwkv7` tensor (see the module docstring).

    Raises:
        ValueError: a tensor name the mapping does not know, or a fused lerp of another count.
    """
    if name in _TOP:
        yield _TOP[name], tensor
        return
    m = _BLOCK.match(name)
    if m is None:
        raise ValueError(f"GGUF rwkv7: unknown tensor {name}")
    layer, part = int(m[1]), m[2]
    prefix = f"model.layers.{layer}."
    lora = _LORA.match(part)
    if part == "time_mix_lerp_fused":
        if tensor.shape[0] not in (5, 6):
            raise ValueError(f"GGUF rwkv7: {name} holds {tensor.shape[0]} lerps, not 5 or 6")
        for key, lerp in zip(_LERP, tensor):  # (1, 1, C) each
            yield f"{prefix}attn.x_{key}", lerp
    elif lora is not None:
        if layer == 0 and lora[1] == "v":
            return
        yield f"{prefix}attn.{lora[1]}_lora.{_LORA_PART[lora[2]]}", tensor
    elif part == "time_mix_r_k":
        yield prefix + "attn.r_k", tensor.reshape(-1, int(config["head_dim"]))
    elif part in _PARAMS:
        yield prefix + _PARAMS[part], tensor
    elif part in _MODULES:
        yield f"{prefix}{_MODULES[part]}.{m[3]}", tensor
    else:
        raise ValueError(f"GGUF rwkv7: unknown tensor {name}")


register_gguf_architecture(GGUFArchitecture("rwkv7", rwkv7_config, rwkv7_tensors))
