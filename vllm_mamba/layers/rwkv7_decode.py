"""How an RWKV-7 decoder layer hands a decode-only step to its family's `decode_layer` op.

A step whose rows are all decodes (no prefill, no speculative chains) runs the whole layer
(layer 0's `pre_norm`, the time mix and the channel mix with their norms and residuals) in one
call of the `rwkv7` family's `decode_layer` (`csrc/fused_decode_rwkv7.cpp` on the `cpp`
backend; `ops.rwkv7.decode_layer_ref` defines it). Elsewhere, and for layers the op does not
cover (tensor-parallel or otherwise modified projections, norms that are not plain
`nn.LayerNorm`s, float16 states, autograd, `VLLM_MAMBA_FUSED_DECODE=0`), `layer_step` returns
None and the layer runs unfused, which is the definition.

The parameter list (`DECODE_LAYER_PARAMS`) is built on first use and kept on the time mix,
rebuilt when its stacked mixes are (`process_weights_after_loading`).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba import envs
from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.layers.fused_decode_layer import _f32, plain_weight
from vllm_mamba.ops.rwkv7 import DECODE_LAYER_PARAMS

_STATE_DTYPES = (torch.float32, torch.bfloat16)
# The projections of `DECODE_LAYER_PARAMS` by their module paths in the time mix ("ffn." in
# the channel mix).
_PROJECTIONS = {
    "r": "r_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
    "w1": "w_lora.lora.0", "w2": "w_lora.lora.2", "a1": "a_lora.lora.0", "a2": "a_lora.lora.2",
    "g1": "g_lora.lora.0", "g2": "g_lora.lora.2", "v1": "v_lora.lora.0", "v2": "v_lora.lora.2",
    "key": "ffn.key", "value": "ffn.value",
}  # fmt: skip


def _norm(module: nn.Module | None, eps: float | None) -> tuple[torch.Tensor, ...] | None:
    """A plain `nn.LayerNorm`'s float32 weight and bias (None without bias), or None."""
    if type(module) is not nn.LayerNorm or module.weight is None:
        return None
    if eps is not None and module.eps != eps:
        return None
    return _f32(module.weight), _f32(module.bias)


def _build(mix: nn.Module, layer: nn.Module, ffn: nn.Module) -> tuple[list, float] | None:
    """`(DECODE_LAYER_PARAMS, norm eps)` of one layer, or None where the op does not apply."""
    names = layer.part_names()
    attn_norm = getattr(layer, names["norm"])
    eps = getattr(attn_norm, "eps", None)
    norms = {
        "pre": _norm(getattr(layer, names["pre_norm"]), eps) if names["pre_norm"] else (None, None),
        "attn": _norm(attn_norm, eps),
        "ffn": _norm(getattr(layer, names["ffn_norm"]), eps),
    }
    if any(n is None for n in norms.values()):
        return None
    p: dict[str, torch.Tensor | None] = {}
    for name, (w, b) in norms.items():
        p[f"{name}_w"], p[f"{name}_b"] = w, b
    modules = {"ffn": ffn}
    for short, path in _PROJECTIONS.items():
        if short in ("v1", "v2") and mix.layer_idx == 0:
            p[f"{short}_w"] = p[f"{short}_s"] = None
            continue
        root, _, rest = path.partition(".") if path.startswith("ffn.") else ("", "", path)
        linear = (modules[root] if root else mix).get_submodule(rest)
        found = plain_weight(linear, mix.ops.linear)
        if found is None or found[2] != mix.mixes.dtype:
            return None
        p[f"{short}_w"], p[f"{short}_s"] = found[0], found[1]
    for short in ("w2", "a2", "v2"):
        bias = None if p[f"{short}_w"] is None else mix.get_submodule(_PROJECTIONS[short]).bias
        p[f"{short}_b"] = _f32(bias)
    p["mixes"] = mix.mixes.contiguous()
    p["cm_x_k"] = ffn.x_k.detach().contiguous()
    for name in ("k_k", "k_a", "r_k"):
        p[name] = getattr(mix, name).detach().contiguous()
    p["gn_w"] = mix.g_norm.weight.detach().contiguous()
    p["gn_b"] = mix.g_norm.bias.detach().contiguous()
    return [p[n] for n in DECODE_LAYER_PARAMS], float(eps)


def layer_step(
    mix: nn.Module, layer: nn.Module, hidden: torch.Tensor, meta: MambaMetadata
) -> torch.Tensor | None:
    """The decoder layer `layer` (whose time mix is `mix`) on a decode-only step of `hidden
    (B, H)` in one call, its three states advanced in place; None where it does not apply."""
    rows = hidden.shape[0]
    if (
        not mix.fused_layer
        or not envs.VLLM_MAMBA_FUSED_DECODE
        or torch.is_grad_enabled()
        or meta.num_prefills
        or meta.decode_waves
        or rows == 0
        or meta.num_decodes != rows
        or hidden.dtype != mix.mixes.dtype
    ):
        return None
    cache = mix.__dict__.setdefault("_decode_layer_params", {})
    entry = cache.get(id(layer))
    if entry is None or entry[0] is not mix.mixes:
        ffn = layer.stateful_ffn()
        entry = cache[id(layer)] = (mix.mixes, ffn, _build(mix, layer, ffn))
    _, ffn, built = entry
    if built is None:
        return None
    states = (mix.state["shift"], mix.state["wkv"], ffn.state["shift"])
    if any(s.dtype not in _STATE_DTYPES for s in states):
        return None
    params, eps = built
    v_first = None if mix.layer_idx == 0 else mix.value_first.value
    out, v = mix.wkv.decode_layer(
        hidden, params, *states, meta.decode_state_indices, v_first, eps, mix.g_norm.eps
    )
    if mix.layer_idx == 0:
        mix.value_first.value = v
    return out
