"""GGUF `lfm2` and `lfm2moe` back onto LFM2 / LFM2-MoE (`Lfm2ForCausalLM`, `Lfm2MoeForCausalLM`).

llama.cpp's `LFM2Model` / `LFM2MoeModel` (`conversion/lfm2.py`) rename the tensors, squeeze the
short conv's filter `(D, 1, L)` to `(D, L)`, stack the experts `w1` / `w3` / `w2` as
`ffn_{gate,up,down}_exps (E, ...)` (per-expert tensors here, in float) and write the
router's `expert_bias` as `exp_probs_b.bias`. Metadata: attention layers are those with a
non-zero `attention.head_count_kv`; `feed_forward_length` is LFM2's SwiGLU width after its
auto-adjustment (so `block_auto_adjust_ff_dim` is off here); the conv has no biases (the
converter squeezes every conv tensor to 2-D, so it writes none). LFM2-MoE: `expert_bias`
used when the file has it; the top-k weights renormalised and not scaled (llama.cpp's
`build_moe_ffn` for LFM2-MoE; no scaling factor is written, as the releases have 1.0).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.gguf.archs._common import (
    LLAMA_GLOBALS,
    Metadata,
    Renamer,
    common_config,
    conv_filter,
    per_layer,
    register_family,
    split_block,
    stacked_experts,
    tensor_names,
)

_GLOBALS = {**LLAMA_GLOBALS, "token_embd_norm.weight": "model.embedding_norm.weight"}
_BLOCK = {
    "attn_norm.weight": "operator_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.out_proj.weight",
    "attn_q_norm.weight": "self_attn.q_layernorm.weight",
    "attn_k_norm.weight": "self_attn.k_layernorm.weight",
    "shortconv.conv.weight": "conv.conv.weight",
    "shortconv.in_proj.weight": "conv.in_proj.weight",
    "shortconv.out_proj.weight": "conv.out_proj.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_gate_inp.weight": "feed_forward.gate.weight",
    "exp_probs_b.bias": "feed_forward.expert_bias",
}
_EXPERTS = {"ffn_gate_exps.weight": "w1", "ffn_down_exps.weight": "w2", "ffn_up_exps.weight": "w3"}


def _config(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    m = Metadata(metadata, arch)
    config = common_config(metadata, m)
    n = config["num_hidden_layers"]
    kv = per_layer(m.get("attention.head_count_kv"), n, f"{arch}.attention.head_count_kv")
    config.update(
        num_attention_heads=m.int("attention.head_count"),
        num_key_value_heads=max(kv),
        layer_types=["full_attention" if heads else "conv" for heads in kv],
        conv_L_cache=m.int("shortconv.l_cache"),
        conv_bias=False,
        norm_eps=config.pop("rms_norm_eps"),
        intermediate_size=m.int("feed_forward_length"),
    )
    if arch == "lfm2":
        config.update(
            architectures=["Lfm2ForCausalLM"], model_type="lfm2", block_auto_adjust_ff_dim=False
        )
        return config
    config.update(
        architectures=["Lfm2MoeForCausalLM"],
        model_type="lfm2_moe",
        moe_intermediate_size=m.int("expert_feed_forward_length"),
        num_dense_layers=m.int("leading_dense_block_count"),
        num_experts=m.int("expert_count"),
        num_experts_per_tok=m.int("expert_used_count"),
        use_expert_bias=any(x.endswith("exp_probs_b.bias") for x in tensor_names(metadata)),
        norm_topk_prob=True,
        routed_scaling_factor=m.float("expert_weights_scale", 1.0),
    )
    return config


def _tensors(
    arch: str, name: str, tensor: torch.Tensor, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    if arch == "lfm2moe":
        experts = stacked_experts(name, tensor, _EXPERTS, "feed_forward", config["num_experts"])
        if experts is not None:
            yield from experts
            return
    if split_block(name)[1] == "shortconv.conv.weight":
        tensor = conv_filter(tensor)  # (D, 1, L)
    yield _RENAME[arch](name), tensor


_RENAME = {arch: Renamer(arch, _GLOBALS, _BLOCK) for arch in ("lfm2", "lfm2moe")}
register_family(tuple(_RENAME), _config, _tensors)
