"""GGUF `nemotron_h` and `nemotron_h_moe` back onto Nemotron-H (`NemotronHForCausalLM`).

llama.cpp's `NemotronHModel` (`conversion/nemotron.py`, a `GraniteHybridModel`) writes one
block per layer: a Mamba2 mixer (`Mamba2Model`'s transforms, `_common.mamba2_tensor`),
attention (q / k rows permuted for llama.cpp's rotary layout, undone row-wise, though the
model has no position embedding), a squared-ReLU MLP (`ffn_up`, `ffn_down`) or the MoE
(`ffn_{up,down}_exps (E, ...)` stacked, per-expert tensors here in float; the router with its
`e_score_correction_bias` as `exp_probs_b.bias`; the shared expert as `ffn_*_shexp`; Nemotron 3
Super's latent projections as `ffn_latent_down` / `ffn_latent_up`, their width in
`moe_latent_size`).

Each layer's kind comes from its tensors (`ssm_in`, `attn_q`, `ffn_gate_inp`, `ffn_up`), the
MLP width from `feed_forward_length` of an MLP layer, else from its `ffn_up` rows (the
converter writes 0 for MLP layers when it takes the model for a MoE: transformers 5 puts MoE
defaults into every Nemotron-H config, so a dense one is written as `nemotron_h_moe`), the
MoE's from the `expert_*` keys. Not in the file, so the class defaults: `chunk_size` (float
rounding only) and `time_step_min` / `time_step_floor` / `time_step_max` (llama.cpp does not
clamp the time step; transformers' default bound, 1e-3, binds only below it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.gguf.archs._common import (
    Metadata,
    common_config,
    mamba2_tensor,
    per_layer,
    register_family,
    rope_qk_tensor,
    split_block,
    tensor_names,
    unstack_experts,
)
from vllm_mamba.gguf.metadata import TENSOR_SHAPES

_GLOBALS = {
    "token_embd.weight": "backbone.embeddings.weight",
    "output_norm.weight": "backbone.norm_f.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm.weight": "norm.weight",
    "attn_v.weight": "mixer.v_proj.weight",
    "attn_v.bias": "mixer.v_proj.bias",
    "attn_output.weight": "mixer.o_proj.weight",
    "attn_output.bias": "mixer.o_proj.bias",
    "ffn_up.weight": "mixer.up_proj.weight",
    "ffn_up.bias": "mixer.up_proj.bias",
    "ffn_down.weight": "mixer.down_proj.weight",
    "ffn_down.bias": "mixer.down_proj.bias",
    "ffn_gate_inp.weight": "mixer.gate.weight",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
    "ffn_up_shexp.bias": "mixer.shared_experts.up_proj.bias",
    "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight",
    "ffn_down_shexp.bias": "mixer.shared_experts.down_proj.bias",
    # Nemotron 3 Super's latent MoE: the experts run in `moe_latent_size` dims between these
    "ffn_latent_down.weight": "mixer.fc1_latent_proj.weight",
    "ffn_latent_down.bias": "mixer.fc1_latent_proj.bias",
    "ffn_latent_up.weight": "mixer.fc2_latent_proj.weight",
    "ffn_latent_up.bias": "mixer.fc2_latent_proj.bias",
}
_KIND = {"ssm_in.weight": "M", "attn_q.weight": "*", "ffn_gate_inp.weight": "E"}


def _pattern(names: list[str], n: int) -> str:
    """The layers' kinds as Nemotron-H's `hybrid_override_pattern` (M, *, -, E)."""
    kinds = ["-"] * n
    found = [False] * n
    for name in names:
        bid, suffix = split_block(name)
        if bid is not None and bid < n and (suffix in _KIND or suffix == "ffn_up.weight"):
            if suffix in _KIND:
                kinds[bid] = _KIND[suffix]
            found[bid] = True
    missing = [i for i, f in enumerate(found) if not f]
    if missing:
        raise ValueError(f"GGUF blocks {missing}: no mixer, attention, MLP or MoE tensors")
    return "".join(kinds)


def _config(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    m = Metadata(metadata, arch)
    names = tensor_names(metadata)
    config = common_config(
        metadata, m, eps_key="attention.layer_norm_epsilon", eps_name="layer_norm_epsilon",
        rope=False,
    )  # fmt: skip
    n = config["num_hidden_layers"]
    pattern = _pattern(names, n)
    kv = per_layer(m.get("attention.head_count_kv"), n, f"{arch}.attention.head_count_kv")
    ff = per_layer(m.get("feed_forward_length"), n, f"{arch}.feed_forward_length")
    heads, inner = m.int("ssm.time_step_rank"), m.int("ssm.inner_size")
    has = lambda suffix: any(x.endswith(suffix) for x in names)  # noqa: E731
    config.update(
        architectures=["NemotronHForCausalLM"],
        model_type="nemotron_h",
        hybrid_override_pattern=pattern,
        num_attention_heads=m.int("attention.head_count"),
        num_key_value_heads=max(kv),
        head_dim=m.int("attention.key_length"),
        mamba_num_heads=heads,
        mamba_head_dim=inner // heads,
        n_groups=m.int("ssm.group_count"),
        ssm_state_size=m.int("ssm.state_size"),
        conv_kernel=m.int("ssm.conv_kernel"),
        use_bias=has("ssm_in.bias"),
        use_conv_bias=has("ssm_conv1d.bias"),
        attention_bias=has("attn_q.bias"),
        mlp_bias=has("ffn_up.bias") or has("ffn_up_shexp.bias"),
    )
    shapes = metadata.get(TENSOR_SHAPES, {})
    mlp = [
        ff[i] or shapes.get(f"blk.{i}.ffn_up.weight", (0,))[0]
        for i, kind in enumerate(pattern)
        if kind == "-"
    ]
    if mlp and mlp[0]:
        config["intermediate_size"] = int(mlp[0])
    elif mlp:
        raise ValueError(f"GGUF metadata {arch}.feed_forward_length: no width for the MLP layers")
    if "E" in pattern:
        config.update(
            n_routed_experts=m.int("expert_count"),
            num_experts_per_tok=m.int("expert_used_count"),
            n_group=m.int("expert_group_count", 1),
            topk_group=m.int("expert_group_used_count", 1),
            moe_intermediate_size=m.int("expert_feed_forward_length"),
            moe_shared_expert_intermediate_size=m.int("expert_shared_feed_forward_length"),
            n_shared_experts=m.int("expert_shared_count", 1),
            norm_topk_prob=bool(m.get("expert_weights_norm", False)),
            routed_scaling_factor=m.float("expert_weights_scale", 1.0),
        )
        latent = m.get("moe_latent_size")
        if latent:
            config["moe_latent_size"] = int(latent)
    return config


def _tensors(
    name: str, tensor: torch.Tensor, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    bid, suffix = split_block(name)
    if bid is None:
        if name not in _GLOBALS:
            raise ValueError(f"GGUF tensor {name!r} is not known for Nemotron-H")
        yield _GLOBALS[name], tensor
        return
    if bid >= config["num_hidden_layers"]:
        return  # the multi-token-prediction block (not run from a GGUF)
    prefix = f"backbone.layers.{bid}."
    mamba = mamba2_tensor(suffix, tensor, prefix + "mixer.")
    if mamba is not None:
        yield mamba
    elif (qk := rope_qk_tensor(suffix, tensor, config, prefix + "mixer.")) is not None:
        yield qk
    elif suffix in ("ffn_up_exps.weight", "ffn_down_exps.weight"):
        proj = "up_proj" if suffix.startswith("ffn_up") else "down_proj"
        template = prefix + "mixer.experts.{}." + proj + ".weight"
        yield from unstack_experts(tensor, template, name, config["n_routed_experts"])
    elif suffix in _BLOCK:
        yield prefix + _BLOCK[suffix], tensor
    else:
        raise ValueError(f"GGUF tensor {name!r} is not known for Nemotron-H")


register_family(("nemotron_h", "nemotron_h_moe"), _config, lambda arch, *args: _tensors(*args))
