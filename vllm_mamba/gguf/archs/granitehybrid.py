"""GGUF `granitehybrid` back onto Granite 4.0-H (`GraniteMoeHybridForCausalLM`) or Bamba.

llama.cpp's `GraniteHybridModel` (`conversion/granite.py`) writes both Granite 4.0-H and Bamba
as `granitehybrid`. Told apart here by what the converter writes for each: Granite's
multipliers (`attention.scale`, `embedding_scale`, `residual_scale`, `logit_scale`) and, for
Bamba only, `rope.scaling.finetuned` true (Granite hybrids run without position embedding in
llama.cpp, whatever their config says: NoPE, as the 4.0-H releases).

Undone here:
- Mamba2 layers as `Mamba2Model` writes them (`_common.mamba2_tensor`); attention layers' q / k
  rows permuted for llama.cpp's rotary layout (`LlamaModel.permute`, undone row-wise).
- Granite: the experts' `input_linear (E, 2F, H)` split into `ffn_gate_exps` / `ffn_up_exps`
  and the shared MLP's `input_linear (2F, H)` into `ffn_{gate,up}_shexp` (or `ffn_gate` /
  `ffn_up` without experts): concatenated back (rows; float for the stacked experts).
- metadata: the SSD width from `ssm.inner_size`, heads from `ssm.time_step_rank`, attention
  layers where `attention.head_count_kv` is non-zero. `mamba_chunk_size` is not written (the
  class default, 256, is used: the SSD's chunking changes float rounding only).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.gguf.arch import GGUFArchitecture, register_gguf_architecture
from vllm_mamba.gguf.archs._common import (
    Metadata,
    Pairs,
    common_config,
    mamba2_tensor,
    per_layer,
    rope_qk_tensor,
    split_block,
    tensor_names,
)
from vllm_mamba.layers.packed_weights import cat_rows

ARCH = "granitehybrid"
_PAIRS = Pairs()


def _is_bamba(m: Metadata) -> bool:
    granite = any(m.has(k) for k in ("attention.scale", "embedding_scale", "residual_scale"))
    return bool(m.get("rope.scaling.finetuned", False)) and not granite


def _config(metadata: dict[str, Any]) -> dict[str, Any]:
    m = Metadata(metadata, ARCH)
    names = set(tensor_names(metadata))
    config = common_config(metadata, m)
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    kv = per_layer(m.get("attention.head_count_kv"), n, f"{ARCH}.attention.head_count_kv")
    attention = [i for i, heads in enumerate(kv) if heads]
    heads, inner = m.int("ssm.time_step_rank"), m.int("ssm.inner_size")
    config.update(
        num_attention_heads=m.int("attention.head_count"),
        num_key_value_heads=max(kv),
        mamba_n_heads=heads,
        mamba_d_head=inner // heads,
        mamba_n_groups=m.int("ssm.group_count"),
        mamba_d_state=m.int("ssm.state_size"),
        mamba_d_conv=m.int("ssm.conv_kernel"),
        mamba_expand=inner // hidden,
        mamba_conv_bias=any(x.endswith("ssm_conv1d.bias") for x in names),
        mamba_proj_bias=any(x.endswith("ssm_in.bias") for x in names),
        attention_bias=any(x.endswith("attn_q.bias") for x in names),
    )
    if _is_bamba(m):
        head_dim = hidden // config["num_attention_heads"]
        config["rope_parameters"]["partial_rotary_factor"] = (
            m.int("rope.dimension_count") / head_dim
        )
        config.update(
            architectures=["BambaForCausalLM"],
            model_type="bamba",
            attn_layer_indices=attention,
            attn_rotary_emb=m.int("rope.dimension_count"),
            intermediate_size=m.int("feed_forward_length"),
            mlp_bias=any(x.endswith("ffn_up.bias") for x in names),
        )
        return config
    experts = m.int("expert_count", 0)
    config.update(
        architectures=["GraniteMoeHybridForCausalLM"],
        model_type="granitemoehybrid",
        layer_types=["attention" if i in attention else "mamba" for i in range(n)],
        position_embedding_type="rope" if m.get("rope.scaling.finetuned", False) else "nope",
        intermediate_size=m.int("feed_forward_length"),
        shared_intermediate_size=m.int("expert_shared_feed_forward_length", 0),
        num_local_experts=experts,
        embedding_multiplier=m.float("embedding_scale", 1.0),
        attention_multiplier=m.float("attention.scale", 1.0),
        residual_multiplier=m.float("residual_scale", 1.0),
        logits_scaling=m.float("logit_scale", 1.0),
    )
    if experts:
        config["num_experts_per_tok"] = m.int("expert_used_count")
    return config


_GRANITE = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate_inp.weight": "block_sparse_moe.router.layer.weight",
    "ffn_down_shexp.weight": "shared_mlp.output_linear.weight",
}
_BAMBA_BLOCK = {
    "ffn_norm.weight": "pre_ff_layernorm.weight",
    "ffn_gate.weight": "feed_forward.gate_proj.weight",
    "ffn_up.weight": "feed_forward.up_proj.weight",
    "ffn_down.weight": "feed_forward.down_proj.weight",
    "ffn_gate.bias": "feed_forward.gate_proj.bias",
    "ffn_up.bias": "feed_forward.up_proj.bias",
    "ffn_down.bias": "feed_forward.down_proj.bias",
}
_GRANITE_BLOCK = {
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_down.weight": "shared_mlp.output_linear.weight",
}
# (group, HF name, the parts concatenated in this order along the output rows)
_FUSED = {
    "ffn_gate_exps.weight": ("exps", "block_sparse_moe.input_linear.weight"),
    "ffn_up_exps.weight": ("exps", "block_sparse_moe.input_linear.weight"),
    "ffn_gate_shexp.weight": ("shexp", "shared_mlp.input_linear.weight"),
    "ffn_up_shexp.weight": ("shexp", "shared_mlp.input_linear.weight"),
    "ffn_gate.weight": ("mlp", "shared_mlp.input_linear.weight"),
    "ffn_up.weight": ("mlp", "shared_mlp.input_linear.weight"),
}


def _tensors(
    name: str, tensor: torch.Tensor, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    bamba = config["model_type"] == "bamba"
    bid, suffix = split_block(name)
    if bid is None:
        if bamba and name == "output_norm.weight":
            yield "model.final_layernorm.weight", tensor
        elif name in _GRANITE:
            yield _GRANITE[name], tensor
        else:
            raise ValueError(f"GGUF tensor {name!r} is not known for architecture {ARCH}")
        return
    prefix = f"model.layers.{bid}."
    mamba = mamba2_tensor(suffix, tensor, prefix + "mamba.")
    if mamba is not None:
        yield mamba
    elif (qk := rope_qk_tensor(suffix, tensor, config, prefix + "self_attn.")) is not None:
        yield qk
    elif bamba and suffix in _BAMBA_BLOCK:
        yield prefix + _BAMBA_BLOCK[suffix], tensor
    elif suffix in _FUSED:
        group, hf = _FUSED[suffix]
        gate, up = suffix.replace("up", "gate"), suffix.replace("gate", "up")
        held = _PAIRS.add(config, bid, group, suffix, tensor, (gate, up))
        if held is not None:
            both = [held[gate], held[up]]
            fused = torch.cat(both, dim=1) if group == "exps" else cat_rows(both)
            yield prefix + hf, fused
    elif suffix == "ffn_down_exps.weight":
        yield prefix + "block_sparse_moe.output_linear.weight", tensor
    elif suffix in _GRANITE_BLOCK:
        yield prefix + _GRANITE_BLOCK[suffix], tensor
    elif suffix in _BLOCK:
        yield prefix + _BLOCK[suffix], tensor
    else:
        raise ValueError(f"GGUF tensor {name!r} is not known for architecture {ARCH}")


register_gguf_architecture(GGUFArchitecture(ARCH, _config, _tensors))
