"""GGUF `qwen35`, `qwen35moe` and `qwen3next` back onto Qwen3.5 / Qwen3.5-MoE / Qwen3-Next.

What llama.cpp's converter (`conversion/qwen.py`, `Qwen3NextModel` and its Qwen3.5 subclasses)
does, undone here:

- metadata: `ssm.state_size` is the GDN key head dim, `ssm.group_count` the key heads,
  `ssm.time_step_rank` the value heads, `ssm.inner_size` value heads x value dim,
  `attention.recurrent_layers` the layer types, `rope.dimension_count` the rotary width
  (the partial rotary factor times the head dim); the `nextn_predict_layers` blocks past
  the model's are its multi-token-prediction head, mapped back to `mtp.*`
  (`mtp_num_hidden_layers`; the engine loads it when MTP speculation is asked for):
  `nextn.eh_proj` -> `mtp.fc`, `nextn.enorm` / `hnorm` / `shared_head_norm` ->
  `mtp.pre_fc_norm_embedding` / `pre_fc_norm_hidden` / `norm`, block tensors under
  `mtp.layers.i`.
- every `*norm.weight` but the GDN's gated norm is written as `1 + w` (the models' norms are
  zero-centred); `A_log` as `A = -exp(A_log)`; the conv filter `(C, 1, K)` squeezed to `(C, K)`;
  `dt_bias` renamed `ssm_dt.bias`; experts stacked as `ffn_{gate,up,down}_exps (E, ...)`
  (per-expert tensors here, in float: the engine's MoE runs float experts).
- Qwen3.5 (both): with fewer key than value heads, the value heads are reordered from grouped
  by key head (`[k0: v0 v1, k1: v0 v1]`) to tiled (`[v0 of k0, v0 of k1, v1 of k0, ...]`)
  in `in_proj_qkv`'s value rows, `in_proj_z`, `in_proj_a` / `in_proj_b`, `A_log`, `dt_bias`, the
  conv's value channels (row permutations: an integer layout is kept) and `out_proj`'s
  columns (whole heads: the layout is kept when a head spans whole groups).
- Qwen3-Next: `in_proj_qkvz` (per key head `[q, k, v, z]`) is split into `attn_qkv` (all q,
  all k, all v) and `attn_gate` (all z); they are interleaved back (rows, layout kept).
  `norm_topk_prob` is not written: llama.cpp always renormalises the top-k (as the releases
  set it); `mlp_only_layers` are the blocks with a dense `ffn_up` (llama.cpp runs a block
  without a router as an MLP; this converter cannot write one: "Can not map tensor
  mlp.down_proj"), `decoder_sparse_step` 1.
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
    minus_one,
    per_layer,
    permute_columns,
    permute_rows,
    register_family,
    split_block,
    tensor_names,
    unstack_experts,
)
from vllm_mamba.layers.packed_weights import cat_rows

_GLOBALS = {**LLAMA_GLOBALS, "output_norm.weight": "model.norm.weight"}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# The multi-token-prediction head's own tensors (the converter's `_QwenMtpMixin` renames).
_NEXTN = {
    "nextn.eh_proj.weight": "mtp.fc.weight",
    "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",  # 1 + w, as every norm
    "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "mtp.norm.weight",
}
_EXPERTS = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
# Norms the converter wrote as `1 + w` (all `*norm.weight` but the GDN's gated norm).
_PLUS_ONE = {"attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight",
             "attn_k_norm.weight"}  # fmt: skip


def _config(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    m = Metadata(metadata, arch)
    head_dim = m.int("attention.key_length")
    config = common_config(metadata, m, partial=m.int("rope.dimension_count") / head_dim)
    n = config["num_hidden_layers"]
    value_heads = m.int("ssm.time_step_rank")
    recurrent = per_layer(m.get("attention.recurrent_layers"), n, f"{arch}.recurrent_layers")
    config.update(
        num_attention_heads=m.int("attention.head_count"),
        num_key_value_heads=m.int("attention.head_count_kv"),
        head_dim=head_dim,
        layer_types=["linear_attention" if r else "full_attention" for r in recurrent],
        **(
            {"mtp_num_hidden_layers": m.int("nextn_predict_layers")}
            if m.has("nextn_predict_layers")
            else {}
        ),
        linear_conv_kernel_dim=m.int("ssm.conv_kernel"),
        linear_key_head_dim=m.int("ssm.state_size"),
        linear_num_key_heads=m.int("ssm.group_count"),
        linear_num_value_heads=value_heads,
        linear_value_head_dim=m.int("ssm.inner_size") // value_heads,
    )
    if arch == "qwen35":
        config.update(
            architectures=["Qwen3_5ForCausalLM"],
            model_type="qwen3_5_text",
            intermediate_size=m.int("feed_forward_length"),
        )
        return config
    config.update(
        num_experts=m.int("expert_count"),
        num_experts_per_tok=m.int("expert_used_count"),
        moe_intermediate_size=m.int("expert_feed_forward_length"),
        shared_expert_intermediate_size=m.int("expert_shared_feed_forward_length"),
    )
    if arch == "qwen35moe":
        config.update(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text")
    else:
        config.update(
            architectures=["Qwen3NextForCausalLM"],
            model_type="qwen3_next",
            intermediate_size=m.int("feed_forward_length"),
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=sorted(
                bid
                for bid, suffix in map(split_block, tensor_names(metadata))
                if suffix == "ffn_up.weight" and bid is not None and bid < n
            ),
        )
    return config


def _untile(n_rows: int, config: dict[str, Any], head_dim: int) -> torch.Tensor:
    """The row index that undoes the converter's grouped-to-tiled value head order.

    GGUF row `(j, h, d)` (j-th value head of key head h) holds HF row `(h, j, d)`: HF row
    `(h, j, d)` is GGUF row `(j * Hk + h) * head_dim + d`.
    """
    hk = config["linear_num_key_heads"]
    per_key = config["linear_num_value_heads"] // hk
    index = torch.arange(n_rows).reshape(per_key, hk, head_dim)  # GGUF order
    return index.permute(1, 0, 2).reshape(-1)  # (Hk, r, d) HF order


def _reordered(config: dict[str, Any]) -> bool:
    return config["linear_num_key_heads"] != config["linear_num_value_heads"]


def _qwen35_gdn(suffix: str, tensor: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """Undoes Qwen3.5's value head reorder on one GDN tensor (see the module docstring)."""
    hk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    dv = config["linear_value_head_dim"]
    v_rows = config["linear_num_value_heads"] * dv
    if suffix in ("attn_qkv.weight", "ssm_conv1d.weight"):
        qk = 2 * hk * dk
        index = torch.cat([torch.arange(qk), qk + _untile(v_rows, config, dv)])
        return permute_rows(tensor, index)
    if suffix == "attn_gate.weight":
        return permute_rows(tensor, _untile(v_rows, config, dv))
    if suffix in ("ssm_alpha.weight", "ssm_beta.weight", "ssm_a", "ssm_dt.bias"):
        return permute_rows(tensor, _untile(tensor.shape[0], config, 1))
    if suffix == "ssm_out.weight":  # columns: whole heads, so whole groups of a layout
        return permute_columns(tensor, _untile(v_rows, config, dv))
    return tensor


def _qwen3next_qkvz(qkv: torch.Tensor, z: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """`in_proj_qkvz` (per key head `[q, k, v, z]`) from the converter's split halves."""
    hk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    vz = config["linear_num_value_heads"] // hk * config["linear_value_head_dim"]  # per key head
    both = cat_rows([qkv, z])  # rows: q (Hk dk), k (Hk dk), v (Hk vz), z (Hk vz)
    k0, v0, z0 = hk * dk, 2 * hk * dk, 2 * hk * dk + hk * vz
    parts = []
    for h in range(hk):
        parts += [
            torch.arange(h * dk, (h + 1) * dk),
            k0 + torch.arange(h * dk, (h + 1) * dk),
            v0 + torch.arange(h * vz, (h + 1) * vz),
            z0 + torch.arange(h * vz, (h + 1) * vz),
        ]
    return permute_rows(both, torch.cat(parts))


_PAIRS = Pairs()  # qwen3next: `attn_qkv` and `attn_gate` of a block


def _tensors(
    arch: str, name: str, tensor: torch.Tensor, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    bid, suffix = split_block(name)
    mtp = bid is not None and bid >= config["num_hidden_layers"]
    if mtp and suffix in _NEXTN:
        yield _NEXTN[suffix], tensor if suffix == "nextn.eh_proj.weight" else minus_one(tensor)
        return
    prefix = f"mtp.layers.{bid - config['num_hidden_layers']}." if mtp else f"model.layers.{bid}."
    if suffix in _EXPERTS:
        template = prefix + "mlp.experts.{}." + _EXPERTS[suffix] + ".weight"
        yield from unstack_experts(tensor, template, name, config["num_experts"])
        return
    if suffix == "ffn_gate_up_exps.weight":  # fused by --fuse-gate-up-exps: (E, 2F, H)
        half = tensor.shape[1] // 2
        for part, rows in (("gate_proj", slice(0, half)), ("up_proj", slice(half, None))):
            template = prefix + "mlp.experts.{}." + part + ".weight"
            yield from unstack_experts(tensor[:, rows], template, name, config["num_experts"])
        return
    if (
        arch == "qwen3next"
        and bid is not None
        and suffix in ("attn_qkv.weight", "attn_gate.weight")
    ):
        parts = ("attn_qkv.weight", "attn_gate.weight")
        held = _PAIRS.add(config, bid, "qkvz", suffix, tensor, parts)
        if held is not None:
            qkvz = _qwen3next_qkvz(held[parts[0]], held[parts[1]], config)
            yield prefix + "linear_attn.in_proj_qkvz.weight", qkvz
        return
    hf = _RENAME[arch](name)
    if mtp:
        hf = prefix + hf.split(".", 3)[3]
    if arch != "qwen3next" and _reordered(config):
        tensor = _qwen35_gdn(suffix, tensor, config)
    if suffix in _PLUS_ONE or name == "output_norm.weight":
        tensor = minus_one(tensor)
    elif suffix == "ssm_a":
        tensor = a_log_from_a(tensor)
    elif suffix == "ssm_conv1d.weight":
        tensor = tensor.reshape(tensor.shape[0], 1, tensor.shape[1])  # (C, 1, K)
    yield hf, tensor


_RENAME = {arch: Renamer(arch, _GLOBALS, _BLOCK) for arch in ("qwen35", "qwen35moe", "qwen3next")}
register_family(tuple(_RENAME), _config, _tensors)
