"""The RWKV-7 ("Goose") wkv ops: the generalised delta rule over a flat varlen batch and its
one-token update. Pure-PyTorch references (`*_ref`), registered as the op family `rwkv7`
(`vllm_mamba.ops.families`); a backend registers faster versions under the same names and
signatures (`cpp`: `csrc/rwkv.cpp`, `triton`: `vllm_mamba.ops.triton_rwkv`).

Per token and head, with the state `S (Dv, Dk)` (row i belongs to value channel i, as the
`rwkv` package's `(H, N, N)` state) and the layer's precomputed inputs

    w (Dk,)  the log decay, <= 0 (RWKV-7: `-exp(-0.5) * sigmoid(w_lora(x))`)
    a (Dk,)  the removal direction (RWKV-7: `-kk`, the L2-normalised `k * k_k`)
    b (Dk,)  the replacement (RWKV-7: `kk * sigmoid(a_lora(x))`)
    k (Dk,), v (Dv,), r (Dk,)

the update and the readout are

    S = S diag(exp(w)) + (S a) b^T + v k^T          o = S r     (Dv,)

Each value row of S evolves on its own: `s_i = s_i * exp(w) + (s_i . a) b + v_i k`, then
`o_i = s_i . r`. The removal `(S a)` reads the state before this token's decay, as the `rwkv`
package's `state * w + state @ ab + vk` does. Math is float32 (the inputs are read in float32,
`exp(w)` computed in float32); the output is rounded once to r's dtype; the state is stored in
its own dtype (float32, or bfloat16 when `ssm_state_dtype` asks), so a continuation reads it
rounded to that dtype.

A prefill chunk runs the recurrence token by token within its sequence, from the slot's saved
state (zeros without an initial state); sequences are independent, so a prefill may be cut at
any token and continued from the saved state with the same result.

Glossary:
    T: tokens in the flat batch; B: sequences (or decode rows); S: state slots; H: heads;
    Dk: key head size (RWKV-7's head size); Dv: value head size (equal to Dk in the released
    models). `query_start_loc (B + 1,)`: sequence `b` owns tokens `[qsl[b], qsl[b + 1])`.
    A state index of `PAD_SLOT_ID` (-1) marks a padding row: its slot is neither read nor
    written, and its outputs are those of a zero state.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.families import OpFamily, OpSpec
from vllm_mamba.ops.int4_linear import dequantize_int4
from vllm_mamba.ops.int8_linear import dequantize_int8

Tensor = torch.Tensor

__all__ = [
    "FAMILY",
    "DECAY_SCALE",
    "wkv7_varlen_ref",
    "wkv7_update_ref",
    "wkv7_step",
    "shift_mix_ref",
    "glue_inputs",
    "glue_output",
    "fused_update_ref",
    "DECODE_LAYER_PARAMS",
    "DecodeLayerParams",
    "decode_layer_ref",
]

FAMILY = "rwkv7"
DECAY_SCALE = math.exp(-0.5)  # w = -exp(-0.5) * sigmoid(.): the log decay lies in (-0.607, 0)


def wkv7_step(
    state: torch.Tensor,
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the rule for a batch of independent states, all float32.

    Args:
        state: `(..., H, Dv, Dk)`; r, w, k, a, b: `(..., H, Dk)`; v: `(..., H, Dv)`.

    Returns:
        `(new state (..., H, Dv, Dk), o (..., H, Dv))`.
    """
    sa = (state * a[..., None, :]).sum(-1, keepdim=True)  # (..., H, Dv, 1): S a
    state = (
        state * torch.exp(w)[..., None, :]
        + sa * b[..., None, :]
        + v[..., :, None] * k[..., None, :]
    )
    return state, (state * r[..., None, :]).sum(-1)


def wkv7_varlen_ref(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """The rule over packed sequences, each from its slot's saved state.

    Args:
        r, w, k, a, b: `(T, H, Dk)`; v: `(T, H, Dv)` (any float dtypes; w may be float32).
        states: `(S, H, Dv, Dk)`; read where `has_initial_state`, then overwritten with each
            sequence's final state (slots of padding rows untouched).
        query_start_loc: `(B + 1,)` int; state_indices: `(B,)` int, `PAD_SLOT_ID` for padding;
        has_initial_state: `(B,)` bool.

    Returns:
        `(T, H, Dv)` in r's dtype.
    """
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)  # (T, H, Dv)
    f = [t.float() for t in (r, w, k, v, a, b)]
    bounds = query_start_loc.tolist()
    for seq, slot in enumerate(state_indices.tolist()):
        start, end = bounds[seq], bounds[seq + 1]
        valid = slot != PAD_SLOT_ID
        if valid and bool(has_initial_state[seq]):
            state = states[slot].float()  # (H, Dv, Dk)
        else:
            state = torch.zeros(states.shape[1:], dtype=torch.float32, device=states.device)
        for t in range(start, end):
            state, out[t] = wkv7_step(state, *(x[t] for x in f))
        if valid:
            states[slot] = state.to(states.dtype)
    return out.to(r.dtype)


def wkv7_update_ref(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    states: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One token per row, the states advanced in place.

    Args:
        r, w, k, a, b: `(B, H, Dk)`; v: `(B, H, Dv)`; states: `(S, H, Dv, Dk)`;
        state_indices: `(B,)`, `PAD_SLOT_ID` rows skipped.

    Returns:
        `(B, H, Dv)` in r's dtype (padding rows: the output of a zero state).
    """
    valid = state_indices != PAD_SLOT_ID  # (B,)
    slots = state_indices.long().clamp(min=0)
    state = states[slots].float() * valid[:, None, None, None]  # (B, H, Dv, Dk)
    state, out = wkv7_step(state, *(x.float() for x in (r, w, k, v, a, b)))
    if bool(valid.any()):
        states[slots[valid]] = state[valid].to(states.dtype)
    return out.to(r.dtype)


def _copied(state: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, b: int) -> torch.Tensor:
    """Row b of a chain: slot `src[b]`'s state copied into its slot `dst[b]` (a live row's),
    and that slot as a one-row index."""
    d, s = int(dst[b]), int(src[b])
    if d != PAD_SLOT_ID and s != d:
        state[d] = state[s]
    return dst[b : b + 1]


def shift_mix_ref(
    x: torch.Tensor,
    shift: torch.Tensor,
    state_indices: torch.Tensor,
    mixes: torch.Tensor,
    src_state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode rows' token shift and mixes: `out[m] = x + (x' - x) * mixes[m]` with `x'` each
    row's saved input (zeros for padding rows), then `x` saved in its place.

    Args:
        x: `(B, H)` one token per row; shift: `(S, H)` every slot's last input (updated in
            place); state_indices: `(B,)`, `PAD_SLOT_ID` rows neither read nor write;
        mixes: `(M, 1, H)` (or `(H,)` for one mix);
        src_state_indices: `(B,)` the slot each row reads `x'` from (speculative chains: the
            rows in order, a row reading what an earlier one saved); None: its own.

    Returns:
        `(M, B, H)` in x's dtype (`(B, H)` for `(H,)` mixes).
    """
    if src_state_indices is not None:
        rows = [
            shift_mix_ref(x[b : b + 1], shift, _copied(shift, state_indices, src_state_indices, b),
                          mixes)
            for b in range(x.shape[0])
        ]  # fmt: skip
        return torch.cat(rows, dim=-2)
    valid = state_indices != PAD_SLOT_ID  # (B,)
    slots = state_indices.long().clamp(min=0)
    prev = (shift[slots] * valid[:, None].to(shift.dtype)).to(x.dtype)  # (B, H)
    if bool(valid.any()):
        shift[slots[valid]] = x[valid].to(shift.dtype)
    return torch.addcmul(x, prev - x, mixes)


def glue_inputs(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    v_first: torch.Tensor | None,
    v_gate: torch.Tensor | None,
    k_k: torch.Tensor,
    k_a: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, ...]:
    """The wkv's inputs from the time mix's projections (the layer's math before the rule).

    Args:
        r, k: `(T, C)`; v: `(T, CV)`; w, a: `(T, C)` the raw `w_lora` and `a_lora` outputs;
        v_first: `(T, CV)` layer 0's value (None in layer 0); v_gate: `(T, CV)` the raw
        `v_lora` output (None in layer 0); k_k, k_a: `(C,)`.

    Returns:
        `(r, w, k, v, a, b)` per head: r, k, a, b `(T, NH, Dk)` in k's dtype, w float32 (the
        log decay), v `(T, NH, Dv)` (lerped towards v_first after layer 0).
    """
    T, C = k.shape
    heads = (T, C // head_dim, head_dim)
    logw = -DECAY_SCALE * torch.sigmoid(w.float())  # (T, C)
    rate = torch.sigmoid(a)  # (T, C)
    kk = F.normalize((k * k_k).view(heads).float(), dim=-1).to(k.dtype)  # (T, NH, Dk)
    k = k * (1 + (rate - 1) * k_a)
    if v_first is not None:
        v = torch.lerp(v, v_first, torch.sigmoid(v_gate))
    vh = v.view(T, C // head_dim, -1)
    rh, kh = r.view(heads), k.view(heads)
    return rh, logw.view(heads), kh, vh, -kk, kk * rate.view(heads)


def glue_output(
    o: torch.Tensor,
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    r_k: torch.Tensor,
    gn_weight: torch.Tensor,
    gn_bias: torch.Tensor,
    gn_eps: float,
) -> torch.Tensor:
    """`(group_norm(o) + sum(r * k * r_k) v) * g`, the input of `o_proj`.

    Args:
        o: `(T, NH, Dv)` the rule's output; r, k: `(T, NH, Dk)` (k after the `k_a` update);
        v: `(T, NH, Dv)`; g: `(T, CV)`; r_k: `(NH, Dk)`; gn_weight, gn_bias: `(CV,)`.

    Returns:
        `(T, CV)` in g's dtype; math in float32.
    """
    of = o.float()
    mean = of.mean(-1, keepdim=True)
    var = (of - mean).square().mean(-1, keepdim=True)
    normed = ((of - mean) * torch.rsqrt(var + gn_eps)).flatten(1)  # (T, CV)
    normed = normed * gn_weight.float() + gn_bias.float()
    bonus = (r.float() * k.float() * r_k.float()).sum(-1, keepdim=True) * v.float()
    return ((normed + bonus.flatten(1)) * g.float()).to(g.dtype)


def fused_update_ref(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    g: torch.Tensor,
    v_first: torch.Tensor | None,
    v_gate: torch.Tensor | None,
    k_k: torch.Tensor,
    k_a: torch.Tensor,
    r_k: torch.Tensor,
    gn_weight: torch.Tensor,
    gn_bias: torch.Tensor,
    gn_eps: float,
    states: torch.Tensor,
    state_indices: torch.Tensor,
    src_state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per row of the whole time mix between its projections and `o_proj`:
    `glue_inputs`, the rule's one-token update (`wkv7_update_ref`), `glue_output`.

    Args: as `glue_inputs` and `glue_output`, one row per sequence (`(B, ...)`); states:
        `(S, NH, Dv, Dk)` advanced in place; state_indices: `(B,)`, `PAD_SLOT_ID` skipped;
        src_state_indices: `(B,)` the slot each row's state is read from (speculative chains,
        the rows in order); None: its own.

    Returns:
        `(B, CV)` in g's dtype.
    """
    if src_state_indices is not None:
        per_row = (r, w, k, v, a, g, v_first, v_gate)
        outs = []
        for b in range(r.shape[0]):
            one = [None if t is None else t[b : b + 1] for t in per_row]
            slot = _copied(states, state_indices, src_state_indices, b)
            consts = (k_k, k_a, r_k, gn_weight, gn_bias, gn_eps)
            outs.append(fused_update_ref(*one, *consts, states, slot))  # type: ignore[arg-type]
        return torch.cat(outs)
    head_dim = r_k.shape[-1]
    rh, wh, kh, vh, ah, bh = glue_inputs(r, w, k, v, a, v_first, v_gate, k_k, k_a, head_dim)
    o = wkv7_update_ref(rh, wh, kh, vh, ah, bh, states, state_indices)
    return glue_output(o, rh, kh, vh, g, r_k, gn_weight, gn_bias, gn_eps)


# The tensors of one decoder layer for `decode_layer`, in order (`csrc/fused_decode_rwkv7.cpp`'s
# `Param`): the norms' weights and biases (`pre_*` layer 0's only) and the LoRAs' biases
# float32; the mixes `(6, 1, H)`, the channel mix's `cm_x_k (H,)`, k_k, k_a, r_k and the group
# norm's `gn_*` in the model dtype; the projection weights `*_w` (float, int8 or 4-bit) with
# their quantisation scales `*_s` at the end (None for float weights). `v1_*` / `v2_*` (the
# value LoRA) are None in layer 0.
DECODE_LAYER_PARAMS = (
    "pre_w", "pre_b", "attn_w", "attn_b", "mixes",
    "r_w", "k_w", "v_w", "o_w",
    "w1_w", "w2_w", "w2_b", "a1_w", "a2_w", "a2_b", "g1_w", "g2_w", "v1_w", "v2_w", "v2_b",
    "k_k", "k_a", "r_k", "gn_w", "gn_b",
    "ffn_w", "ffn_b", "cm_x_k", "key_w", "value_w",
    "r_s", "k_s", "v_s", "o_s", "w1_s", "w2_s", "a1_s", "a2_s", "g1_s", "g2_s", "v1_s", "v2_s",
    "key_s", "value_s",
)  # fmt: skip
# `params` by name: `list(DecodeLayerParams(**tensors))`, the fields in the order above.
DecodeLayerParams = NamedTuple(
    "DecodeLayerParams", [(n, "Tensor | None") for n in DECODE_LAYER_PARAMS]
)


def _project(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x @ weight^T + bias` in float32 (an int8 or 4-bit weight dequantised), in x's dtype."""
    if scale is None:
        w = weight.float()
    elif weight.dtype == torch.uint8:
        w = dequantize_int4(weight, scale, torch.float32)
    else:
        w = dequantize_int8(weight, scale, torch.float32)
    return F.linear(x.float(), w, bias).to(x.dtype)


def decode_layer_ref(
    hidden: torch.Tensor,
    params: list[torch.Tensor | None],
    tm_shift: torch.Tensor,
    wkv_states: torch.Tensor,
    cm_shift: torch.Tensor,
    state_indices: torch.Tensor,
    v_first: torch.Tensor | None,
    norm_eps: float,
    gn_eps: float,
    src_state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One whole RWKV-7 decoder layer for one decode token per row (`models/rwkv7.py`'s
    layer: `pre_norm` in layer 0, the time mix and the channel mix with their norms and
    residuals), the states advanced in place. Every tensor between two ops holds the model
    dtype (hidden's), as in the unfused layer.

    Args:
        hidden: `(B, H)` the layer's input; params: `DECODE_LAYER_PARAMS`;
        tm_shift, cm_shift: `(S, H)` the two token shifts; wkv_states: `(S, NH, Dv, Dk)`;
        state_indices: `(B,)`, `PAD_SLOT_ID` rows neither read nor write;
        v_first: `(B, CV)` layer 0's value (None in layer 0);
        src_state_indices: `(B,)` the slot each row reads its three states from (speculative
            chains: the rows in order, a row reading what an earlier one wrote); None: its own.

    Returns:
        `(hidden (B, H), v (B, CV))`: the layer's output and its value before the v_first lerp
        (layer 0's is every later layer's `v_first`).
    """
    p = dict(zip(DECODE_LAYER_PARAMS, params, strict=True))
    dtype, width = hidden.dtype, (hidden.shape[-1],)

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x.float(), width, p[f"{name}_w"], p[f"{name}_b"], norm_eps).to(dtype)

    def proj(x: torch.Tensor, name: str) -> torch.Tensor:
        return _project(x, p[f"{name}_w"], p[f"{name}_s"], p.get(f"{name}_b"))

    h = norm(hidden, "pre") if p["pre_w"] is not None else hidden
    src = src_state_indices
    mixed = shift_mix_ref(norm(h, "attn"), tm_shift, state_indices, p["mixes"], src)
    xr, xw, xk, xv, xa, xg = mixed.unbind(0)
    r, k, v = proj(xr, "r"), proj(xk, "k"), proj(xv, "v")
    w = proj(torch.tanh(proj(xw, "w1")), "w2")
    a = proj(proj(xa, "a1"), "a2")
    g = proj(torch.sigmoid(proj(xg, "g1")), "g2")
    gate = None if v_first is None else proj(proj(xv, "v1"), "v2")
    o = fused_update_ref(
        r, w, k, v, a, g, v_first, gate, p["k_k"], p["k_a"], p["r_k"], p["gn_w"], p["gn_b"],
        gn_eps, wkv_states, state_indices, src,
    )  # fmt: skip
    h = h + proj(o, "o")
    xk = shift_mix_ref(norm(h, "ffn"), cm_shift, state_indices, p["cm_x_k"], src)
    return h + proj(torch.relu(proj(xk, "key")).square(), "value"), v


class VarlenOp(Protocol):
    def __call__(
        self, r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, states: Tensor,
        query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    ) -> Tensor: ...  # fmt: skip


class UpdateOp(Protocol):
    def __call__(
        self, r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, states: Tensor,
        state_indices: Tensor,
    ) -> Tensor: ...  # fmt: skip


class ShiftMixOp(Protocol):
    def __call__(
        self, x: Tensor, shift: Tensor, state_indices: Tensor, mixes: Tensor,
        src_state_indices: Tensor | None = None,
    ) -> Tensor: ...  # fmt: skip


class FusedUpdateOp(Protocol):
    def __call__(
        self, r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, g: Tensor,
        v_first: Tensor | None, v_gate: Tensor | None, k_k: Tensor, k_a: Tensor, r_k: Tensor,
        gn_weight: Tensor, gn_bias: Tensor, gn_eps: float, states: Tensor, state_indices: Tensor,
        src_state_indices: Tensor | None = None,
    ) -> Tensor: ...  # fmt: skip


class DecodeLayerOp(Protocol):
    def __call__(
        self, hidden: Tensor, params: list[Tensor | None], tm_shift: Tensor, wkv_states: Tensor,
        cm_shift: Tensor, state_indices: Tensor, v_first: Tensor | None, norm_eps: float,
        gn_eps: float, src_state_indices: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    FAMILY,
    {
        "varlen": OpSpec(VarlenOp, wkv7_varlen_ref),
        "update": OpSpec(UpdateOp, wkv7_update_ref),
        "shift_mix": OpSpec(ShiftMixOp, shift_mix_ref),
        "fused_update": OpSpec(FusedUpdateOp, fused_update_ref),
        "decode_layer": OpSpec(DecodeLayerOp, decode_layer_ref),
    },
)
