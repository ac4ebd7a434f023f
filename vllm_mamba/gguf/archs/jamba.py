"""GGUF `jamba` back onto Jamba (`JambaForCausalLM`).

llama.cpp's `JambaModel` (`conversion/jamba.py`) renames the tensors, writes `A_log` as
`A = -exp(A_log)` and squeezes the conv filter `(D, 1, K)` to `(D, K)`; experts are stacked as
`ffn_{gate,up,down}_exps (E, ...)` (per-expert tensors here, in float). Metadata: the
attention layers are those with a non-zero `attention.head_count_kv` (read back as Jamba's
period and offset); the expert layers are those with a router (`ffn_gate_inp`), likewise;
the Mamba width `ssm.inner_size`, `ssm.time_step_rank` the time-step rank; biases from the
tensors present.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.gguf.archs._common import (
    LLAMA_GLOBALS,
    Metadata,
    Renamer,
    a_log_from_a,
    common_config,
    conv_filter,
    per_layer,
    register_family,
    split_block,
    stacked_experts,
    tensor_names,
)

_GLOBALS = {**LLAMA_GLOBALS, "output_norm.weight": "model.final_layernorm.weight"}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "pre_ff_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ssm_a": "mamba.A_log",
    "ssm_d": "mamba.D",
    "ssm_b_norm.weight": "mamba.b_layernorm.weight",
    "ssm_c_norm.weight": "mamba.c_layernorm.weight",
    "ssm_dt_norm.weight": "mamba.dt_layernorm.weight",
    "ssm_conv1d.weight": "mamba.conv1d.weight",
    "ssm_conv1d.bias": "mamba.conv1d.bias",
    "ssm_dt.weight": "mamba.dt_proj.weight",
    "ssm_dt.bias": "mamba.dt_proj.bias",
    "ssm_in.weight": "mamba.in_proj.weight",
    "ssm_in.bias": "mamba.in_proj.bias",
    "ssm_out.weight": "mamba.out_proj.weight",
    "ssm_out.bias": "mamba.out_proj.bias",
    "ssm_x.weight": "mamba.x_proj.weight",
    "ffn_gate.weight": "feed_forward.gate_proj.weight",
    "ffn_up.weight": "feed_forward.up_proj.weight",
    "ffn_down.weight": "feed_forward.down_proj.weight",
    "ffn_gate_inp.weight": "feed_forward.router.weight",
}
_EXPERTS = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
_RENAME = Renamer("jamba", _GLOBALS, _BLOCK)


def _period(layers: list[int], n: int, what: str) -> tuple[int, int]:
    """(period, offset) with `layers == [i for i < n if i % period == offset]`."""
    if not layers:
        raise ValueError(f"GGUF jamba: no {what} layer")
    offset = layers[0]
    period = layers[1] - layers[0] if len(layers) > 1 else n
    if [i for i in range(n) if i % period == offset % period and i >= offset] != layers:
        raise ValueError(f"GGUF jamba: {what} layers {layers} are not periodic")
    return period, offset


def _config(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    m = Metadata(metadata, arch)
    names = tensor_names(metadata)
    config = common_config(metadata, m, rope=False)
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    kv = per_layer(m.get("attention.head_count_kv"), n, "jamba.attention.head_count_kv")
    attn_period, attn_offset = _period([i for i, h in enumerate(kv) if h], n, "attention")
    routed = sorted({b for b, s in map(split_block, names) if s == "ffn_gate_inp.weight"})
    has = lambda suffix: any(x.endswith(suffix) for x in names)  # noqa: E731
    config.update(
        architectures=["JambaForCausalLM"],
        model_type="jamba",
        intermediate_size=m.int("feed_forward_length"),
        num_attention_heads=m.int("attention.head_count"),
        num_key_value_heads=max(kv),
        attn_layer_period=attn_period,
        attn_layer_offset=attn_offset,
        mamba_d_state=m.int("ssm.state_size"),
        mamba_d_conv=m.int("ssm.conv_kernel"),
        mamba_expand=m.int("ssm.inner_size") // hidden,
        mamba_dt_rank=m.int("ssm.time_step_rank"),
        mamba_conv_bias=has("ssm_conv1d.bias"),
        mamba_proj_bias=has("ssm_in.bias"),
    )
    if routed:
        period, offset = _period(routed, n, "expert")
        config.update(
            num_experts=m.int("expert_count"),
            num_experts_per_tok=m.int("expert_used_count"),
            expert_layer_period=period,
            expert_layer_offset=offset,
        )
    else:
        config.update(num_experts=1, num_experts_per_tok=1, expert_layer_period=1,
                      expert_layer_offset=0)  # fmt: skip
    return config


def _tensors(
    arch: str, name: str, tensor: torch.Tensor, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    experts = stacked_experts(name, tensor, _EXPERTS, "feed_forward", config["num_experts"])
    if experts is not None:
        yield from experts
        return
    _, suffix = split_block(name)
    if suffix == "ssm_a":
        tensor = a_log_from_a(tensor)
    elif suffix == "ssm_conv1d.weight":
        tensor = conv_filter(tensor)
    yield _RENAME(name), tensor


register_family(("jamba",), _config, _tensors)
