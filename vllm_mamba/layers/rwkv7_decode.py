"""How an RWKV-7 decoder layer's decode-only steps run as one call of its family's `decode_layer`.

`plan_layer` decides at plan time (`layers.decode_plan`) whether the whole layer (layer 0's
`pre_norm`, the time mix and the channel mix with their norms and residuals) runs in one call
of the `rwkv7` family's `decode_layer` (`csrc/fused_decode_rwkv7.cpp` on the `cpp` backend;
`ops.rwkv7.decode_layer_ref` defines it), and builds its parameter list once
(`DecodeLayerParams`, by name). It returns None, and the layer runs unfused (which is the
definition), where the op does not apply: a backend without its own op, tensor-parallel or
otherwise modified projections, integer-dot projections (`quantization="w8a8"` / `"w4a8"`:
the kernel's products are weight-only), norms that are not plain `nn.LayerNorm`s of one
epsilon, float16 states. Per step `FusedRwkv7Step.takes` asks only whether the step is decode-only
(no prefill, no autograd; speculative chains up to `CHAIN_MAX_ROWS` rows, which the op runs in
order, each row reading the states the row before wrote) with an input in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.layers.decode_plan import CHAIN_MAX_ROWS, decode_only, decode_slots
from vllm_mamba.layers.fused_decode_layer import _f32, plain_weight
from vllm_mamba.layers.quantization import uses_int_dot
from vllm_mamba.ops.rwkv7 import DecodeLayerParams

_STATE_DTYPES = (torch.float32, torch.bfloat16)
# The projections of `DecodeLayerParams` by their module paths in the time mix ("ffn." in
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
    """`(DecodeLayerParams as a list, norm eps)` of one layer, or None where the op does not
    apply."""
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
        if found is None or found[2] != mix.mixes.dtype or uses_int_dot(linear):
            return None  # (the kernel's products are weight-only: integer dots run unfused)
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
    return list(DecodeLayerParams(**p)), float(eps)


@dataclass(frozen=True, eq=False)
class FusedRwkv7Step:
    """An RWKV-7 decoder layer's decode-only step in one `decode_layer` call: `params` its
    list (built once), `eps` its LayerNorms' epsilon, `gn_eps` its group norm's; `mix` and
    `ffn` hold the states, layer 0's (`first`) value is every later layer's `v_first`."""

    mix: nn.Module
    ffn: nn.Module
    params: list[torch.Tensor | None]
    eps: float
    gn_eps: float
    first: bool

    def takes(self, hidden: torch.Tensor, meta: MambaMetadata) -> bool:
        """A decode-only step (speculative chains included), its input in the model dtype."""
        return hidden.dtype == self.mix.mixes.dtype and decode_only(
            hidden, meta, chain_rows=CHAIN_MAX_ROWS
        )

    def __call__(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """The layer on `hidden (B, H)` -> `(B, H)`, its three states advanced in place."""
        mix = self.mix
        states = (mix.state["shift"], mix.state["wkv"], self.ffn.state["shift"])
        v_first = None if self.first else mix.value_first.value
        slots, src = decode_slots(meta)
        out, v = mix.wkv.decode_layer(
            hidden, self.params, *states, slots, v_first, self.eps, self.gn_eps, src
        )
        if self.first:
            mix.value_first.value = v
        return out


def plan_layer(mix: nn.Module, layer: nn.Module) -> FusedRwkv7Step | None:
    """The decoder layer `layer` (whose time mix is `mix`, its stateful feed-forward the
    channel mix) as one fused step, or None where the op does not apply."""
    if not mix.fused_layer:
        return None
    ffn = layer.stateful_ffn()
    if not mix.state or not ffn.state:  # not bound
        return None
    states = (mix.state["shift"], mix.state["wkv"], ffn.state["shift"])
    if any(s.dtype not in _STATE_DTYPES for s in states):
        return None
    built = _build(mix, layer, ffn)
    if built is None:
        return None
    params, eps = built
    return FusedRwkv7Step(mix, ffn, params, eps, mix.g_norm.eps, mix.layer_idx == 0)
