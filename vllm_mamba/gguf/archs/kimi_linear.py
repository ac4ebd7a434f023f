"""GGUF `kimi-linear` back onto Kimi Linear (`KimiLinearForCausalLM`).

llama.cpp's `KimiLinearModel` (`conversion/kimi_linear.py`, for Moonshot's checkpoint layout:
`block_sparse_moe.*` MoEs, `mlp.*` dense layers) writes `A_log (1, 1, H, 1)` as
`-exp(A_log)`, the KDA convs `(C, 1, K)` as `(1, C, 1, K)`, `dt_bias` as `ssm_dt.bias`,
stacks the experts `w1` / `w3` / `w2` as `ffn_{gate,up,down}_exps (E, ...)` (per-expert
tensors here, in float) and splits MLA's `kv_b_proj (H (nope + v), R)` into
`attn_k_b (H, R, nope)` (transposed) and `attn_v_b (H, v, R)` (joined back here, in float).
Metadata: MLA layers have a non-zero `attention.head_count_kv` (written as 1: llama.cpp runs
MLA as MQA; the model's key/value heads are its query heads); the KDA heads from `ssm_a`'s
shape; `leading_dense_block_count` dense layers, then MoEs; the top-k renormalised (llama.cpp
always does); `expert_group_count` when written, else one group.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.gguf.archs._common import (
    LLAMA_GLOBALS,
    Metadata,
    Pairs,
    Renamer,
    a_log_from_a,
    common_config,
    per_layer,
    register_family,
    split_block,
    stacked_experts,
)
from vllm_mamba.gguf.metadata import TENSOR_SHAPES

_GLOBALS = {**LLAMA_GLOBALS, "output_norm.weight": "model.norm.weight"}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ssm_a": "self_attn.A_log",
    "ssm_dt.bias": "self_attn.dt_bias",
    "ssm_beta.weight": "self_attn.b_proj.weight",
    "ssm_f_a.weight": "self_attn.f_a_proj.weight",
    "ssm_f_b.weight": "self_attn.f_b_proj.weight",
    "ssm_g_a.weight": "self_attn.g_a_proj.weight",
    "ssm_g_b.weight": "self_attn.g_b_proj.weight",
    "ssm_norm.weight": "self_attn.o_norm.weight",
    "ssm_conv1d_q.weight": "self_attn.q_conv1d.weight",
    "ssm_conv1d_k.weight": "self_attn.k_conv1d.weight",
    "ssm_conv1d_v.weight": "self_attn.v_conv1d.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "exp_probs_b.bias": "block_sparse_moe.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "block_sparse_moe.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "block_sparse_moe.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "block_sparse_moe.shared_experts.down_proj.weight",
}
_EXPERTS = {"ffn_gate_exps.weight": "w1", "ffn_down_exps.weight": "w2", "ffn_up_exps.weight": "w3"}
_RENAME = Renamer("kimi-linear", _GLOBALS, _BLOCK)
_PAIRS = Pairs()  # attn_k_b and attn_v_b of a block


def _config(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    m = Metadata(metadata, arch)
    config = common_config(metadata, m, rope=False)
    n = config["num_hidden_layers"]
    kv = per_layer(m.get("attention.head_count_kv"), n, f"{arch}.attention.head_count_kv")
    layer_types = ["full_attention" if h else "linear_attention" for h in kv]
    shapes = metadata.get(TENSOR_SHAPES, {})
    kda = [shapes.get(f"blk.{i}.ssm_a") for i, t in enumerate(layer_types) if t != "full_attention"]
    if not kda or kda[0] is None:
        raise ValueError("GGUF kimi-linear: no KDA layer's ssm_a (the KDA head count)")
    heads = m.int("attention.head_count")
    rope = m.int("rope.dimension_count")
    dense = m.int("leading_dense_block_count", 0)
    config.update(
        architectures=["KimiLinearForCausalLM"],
        model_type="kimi_linear",
        layer_types=layer_types,
        mlp_layer_types=["dense" if i < dense else "sparse" for i in range(n)],
        intermediate_size=m.int("feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        linear_num_heads=int(kda[0][2]),
        linear_head_dim=m.int("kda.head_dim"),
        linear_conv_kernel_dim=m.int("ssm.conv_kernel"),
        q_lora_rank=m.int("attention.q_lora_rank") if m.has("attention.q_lora_rank") else None,
        kv_lora_rank=m.int("attention.kv_lora_rank"),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=m.int("attention.key_length_mla") - rope,
        v_head_dim=m.int("attention.value_length_mla"),
        num_local_experts=m.int("expert_count"),
        num_experts_per_tok=m.int("expert_used_count"),
        n_group=m.int("expert_group_count", 1),
        topk_group=m.int("expert_group_used_count", 1),
        norm_topk_prob=True,
        routed_scaling_factor=m.float("expert_weights_scale", 1.0),
        moe_intermediate_size=m.int("expert_feed_forward_length"),
        n_shared_experts=m.int("expert_shared_count", 0),
    )
    return config


def _tensors(
    arch: str, name: str, tensor: torch.Tensor, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    count = config["num_local_experts"]
    experts = stacked_experts(name, tensor, _EXPERTS, "block_sparse_moe", count)
    if experts is not None:
        yield from experts
        return
    bid, suffix = split_block(name)
    prefix = f"model.layers.{bid}."
    if suffix in ("attn_k_b.weight", "attn_v_b.weight"):
        parts = ("attn_k_b.weight", "attn_v_b.weight")
        held = _PAIRS.add(config, bid, "kv_b", suffix, tensor, parts)
        if held is not None:
            k_b = held[parts[0]].transpose(1, 2)  # (H, nope, R)
            kv_b = torch.cat([k_b, held[parts[1]]], dim=1)  # (H, nope + v, R)
            yield prefix + "self_attn.kv_b_proj.weight", kv_b.reshape(-1, kv_b.shape[-1])
        return
    if suffix == "ssm_a":
        tensor = a_log_from_a(tensor)
    elif suffix.startswith("ssm_conv1d_"):
        tensor = tensor.reshape(tensor.shape[1], 1, tensor.shape[3])  # (C, 1, K)
    yield _RENAME(name), tensor


register_family(("kimi-linear",), _config, _tensors)
