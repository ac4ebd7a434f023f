"""LFM2's gated short conv as one op family, `short_conv`: `C * conv(B * x)` straight from the
in_proj output, over a flat varlen batch (`varlen`) and one token per row (`update`).
`decode_layer` is a whole block's decode step in one call (norm, in_proj, the gated conv,
out_proj, residual: `csrc/fused_decode_short_conv.cpp`). Pure-PyTorch references (`*_ref`),
registered as the op family `short_conv`
(`vllm_mamba.ops.families`); a backend registers faster versions under the same names and
signatures (`cpp`: `csrc/short_conv.cpp`, `triton`: `vllm_mamba.ops.triton_short_conv`).

Per token, with `bcx = [B | C | x]` the in_proj output (LFM2's `B, C, x = in_proj(h).chunk(3)`):

    u = B * x                                   (D,)
    y = bias + sum_k weight[:, k] * u_{t - (K - 1) + k}     depthwise causal conv, no activation
    out = C * y                                 (D,)

where `u` before a sequence's first token comes from its slot's saved history (zeros without an
initial state). The per-slot state is that history alone: `conv_states (S, D, K - 1)`, the last
`K - 1` values of `u`, oldest first (the same layout as `causal_conv1d`'s). Math is float32
(`u` and `y` in float32, the output rounded once to bcx's dtype); the history is stored in the
state's dtype, so a continuation reads `u` rounded to it.

Glossary:
    T: tokens in the flat batch; B: sequences (or decode rows); D: channels; K: conv width;
    S: state slots. `bcx`: `(T, 3D)` (or `(B, 3D)`); weight: `(D, K)`; bias: `(D,)` or None.
    `query_start_loc` is `(B + 1,)`: sequence `b` owns tokens `[qsl[b], qsl[b + 1])`.
    A state index of `PAD_SLOT_ID` (-1) marks a padding row: its slot is neither read nor
    written, and its outputs are those of a zero history.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.causal_conv1d import causal_conv1d_varlen_ref
from vllm_mamba.ops.families import OpFamily, OpSpec
from vllm_mamba.ops.fused_decode import _chained, _finish, _linear, _rms_norm

Tensor = torch.Tensor

__all__ = [
    "FAMILY",
    "SHORT_CONV_PARAMS",
    "ShortConvParams",
    "decode_layer_ref",
    "short_conv_update_ref",
    "short_conv_varlen_ref",
    "split_bcx",
]

FAMILY = "short_conv"


def split_bcx(bcx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`B, C, x` of the in_proj output `bcx (..., 3D)`: views `(..., D)` each, in this order."""
    b, c, x = bcx.chunk(3, dim=-1)
    return b, c, x


def short_conv_varlen_ref(
    bcx: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """`C * conv(B * x)` over packed sequences, each starting from its slot's saved history.

    Args:
        bcx: `(T, 3D)` the in_proj output `[B | C | x]`, sequences packed back to back.
        conv_states: `(S, D, K - 1)`; read where `has_initial_state`, then overwritten with
            each sequence's last `K - 1` values of `B * x` (slots of padding rows untouched).
        weight: `(D, K)` depthwise filters; bias: `(D,)` or None.
        query_start_loc: `(B + 1,)` int, cumulative sequence starts.
        state_indices: `(B,)` int slot per sequence, `PAD_SLOT_ID` for padding.
        has_initial_state: `(B,)` bool; False starts the sequence from zeros.

    Returns:
        `(T, D)` in bcx's dtype.
    """
    b, c, x = split_bcx(bcx)
    u = b.float() * x.float()  # (T, D)
    # (T, D) float32: the conv of the float32 u, the history saved in the state's dtype
    y = causal_conv1d_varlen_ref(
        u, weight, bias, conv_states, query_start_loc, state_indices, has_initial_state,
        activation=False,
    )  # fmt: skip
    return (c.float() * y).to(bcx.dtype)


def short_conv_update_ref(
    bcx: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One token per row: convolve `B * x` with the saved history, shift it in, gate by `C`.

    Args:
        bcx: `(B, 3D)` the in_proj output `[B | C | x]` of each row's new token.
        conv_states: `(S, D, K - 1)`, updated in place for the non-padding rows.
        weight: `(D, K)`; bias: `(D,)` or None.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.

    Returns:
        `(B, D)` in bcx's dtype (padding rows: the output of a zero history).
    """
    b, c, x = split_bcx(bcx)
    u = b.float() * x.float()  # (B, D)
    valid = state_indices != PAD_SLOT_ID  # (B,)
    slots = state_indices.long().clamp(min=0)
    history = conv_states[slots].float() * valid[:, None, None]  # (B, D, K - 1)
    window = torch.cat([history, u[:, :, None]], dim=-1)  # (B, D, K)
    y = (window * weight.float()).sum(-1)  # (B, D)
    if bias is not None:
        y = y + bias.float()
    if bool(valid.any()):
        conv_states[slots[valid]] = window[valid, :, 1:].to(conv_states.dtype)
    return (c.float() * y).to(bcx.dtype)


class UpdateOp(Protocol):
    def __call__(
        self, bcx: Tensor, conv_states: Tensor, weight: Tensor, bias: Tensor | None,
        state_indices: Tensor,
    ) -> Tensor: ...  # fmt: skip


# The tensors of one short-conv block for `decode_layer`, in order (the `Param` of
# `csrc/fused_decode_short_conv.cpp`); `list(ShortConvParams(**tensors))`.
SHORT_CONV_PARAMS = (
    "norm_w", "in_proj_w", "in_proj_b", "conv_w", "conv_b", "out_proj_w", "out_proj_b",
    "in_proj_scale", "out_proj_scale",
)  # fmt: skip
ShortConvParams = NamedTuple("ShortConvParams", [(n, "Tensor | None") for n in SHORT_CONV_PARAMS])


def decode_layer_ref(
    hidden: torch.Tensor,
    params: list[torch.Tensor | None],
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    norm_eps: float,
    out_dtype: torch.dtype,
    src_state_indices: torch.Tensor | None = None,
    int_dot: bool = False,
) -> torch.Tensor:
    """One short-conv block's decode step (`hidden + out_proj(C * conv(B * x))` with
    `B, C, x = in_proj(norm(hidden))`, or the mixer alone without a norm) from the reference
    ops; the histories advanced in place.

    Args:
        hidden: `(B, H)` the block input (norm_w given) or the mixer input.
        params: the tensors named by `SHORT_CONV_PARAMS`: norm_w `(H,)` float32 or None,
            in_proj_w `(3D, H)`, in_proj_b `(3D,)`, conv_w `(D, K)`, conv_b `(D,)`, out_proj_w
            `(H, D)`, out_proj_b `(H,)` and the two weights' scales (None for float weights,
            `(rows,)` float32 for int8, `(rows, cols/32)` float16 for 4-bit).
        conv_states: `(S, D, K - 1)`, updated in place.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.
        norm_eps: the block norm's epsilon (unused without norm_w).
        out_dtype: the result's dtype.
        src_state_indices: `(B,)` the slot each row reads its history from (speculative
            chains: rows run in order).
        int_dot: the integer weights multiply int8-quantised activations (`_linear`).

    Returns:
        `(B, H)` in `out_dtype`.
    """
    if src_state_indices is not None:
        return _chained(
            decode_layer_ref, hidden, (conv_states,), state_indices, src_state_indices, params,
            conv_states, norm_eps=norm_eps, out_dtype=out_dtype,
        )  # fmt: skip
    p = dict(zip(SHORT_CONV_PARAMS, params, strict=True))
    x = hidden.float()
    xn = _rms_norm(x, p["norm_w"], norm_eps) if p["norm_w"] is not None else x
    bcx = _linear(xn, p["in_proj_w"], p["in_proj_b"], p["in_proj_scale"], int_dot)  # (B, 3D)
    gated = short_conv_update_ref(bcx, conv_states, p["conv_w"], p["conv_b"], state_indices)
    mixed = _linear(gated, p["out_proj_w"], p["out_proj_b"], p["out_proj_scale"], int_dot)
    return _finish(hidden, mixed, p["norm_w"] is not None, out_dtype)


class DecodeLayerOp(Protocol):
    def __call__(
        self, hidden: Tensor, params: list[Tensor | None], conv_states: Tensor,
        state_indices: Tensor, norm_eps: float, out_dtype: torch.dtype,
        src_state_indices: Tensor | None = None, int_dot: bool = False,
    ) -> Tensor: ...  # fmt: skip


class VarlenOp(Protocol):
    def __call__(
        self, bcx: Tensor, conv_states: Tensor, weight: Tensor, bias: Tensor | None,
        query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    FAMILY,
    {
        "update": OpSpec(UpdateOp, short_conv_update_ref),
        "varlen": OpSpec(VarlenOp, short_conv_varlen_ref),
        "decode_layer": OpSpec(DecodeLayerOp, decode_layer_ref),
    },
)
