"""A depthwise causal conv whose taps change per token, as one op family, `dynamic_conv`
(Inkling 2's convs over the keys and values of its full-attention layers,
`layers.dynamic_short_conv`): `varlen` over a flat varlen batch, `update` for one token per row.

Each token `t` brings its own taps: a static part per channel and a dynamic part per head,

    w[t, c, l] = static_weight[l, c] + dynamic_taps[t, c // (C / Hc), l]    # l: lag, 0 = now
    y[t, c] = sum_l w[t, c, l] * x[t - l, c]                                 # float32

summed in lag order. A sequence's inputs before its first token are its slot's saved history
`conv (S, C, K - 1)` (its last `K - 1` inputs, oldest first, float32), or zeros for a fresh
sequence; after the step each slot holds its sequence's last `K - 1` inputs (history rows
among them when the chunk is shorter). The layer adds the residual and the scale.

Pure-PyTorch references (`*_ref`), registered as the op family (`vllm_mamba.ops.families`);
the C++ kernels (`csrc/dynamic_conv.cpp`) and Triton kernels (`triton_dynamic_conv`) register
faster versions under the same names and signatures.

Glossary:
    T: tokens in the flat batch; B: sequences (or decode rows); C: channels; Hc: heads whose
    channels share the dynamic taps (`C / Hc` each); K: conv width; S: state slots.
    `query_start_loc` is `(B + 1,)`: sequence `b` owns tokens `[qsl[b], qsl[b + 1])`. A state
    index of `PAD_SLOT_ID` (-1) marks a padding row: its slot is neither read nor written.
"""

from __future__ import annotations

from typing import Protocol

import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.families import OpFamily, OpSpec

Tensor = torch.Tensor
FAMILY = "dynamic_conv"


def _apply_taps(
    windows: torch.Tensor, static_weight: torch.Tensor, dynamic_taps: torch.Tensor
) -> torch.Tensor:
    """`windows (T, C, K)` oldest first, `static_weight (K, C)`, `dynamic_taps (T, Hc, K)` ->
    `(T, C)` float32, the taps applied in lag order."""
    tokens, channels, width = windows.shape
    heads = dynamic_taps.shape[1]
    static = static_weight.float().T.reshape(heads, channels // heads, width)  # (Hc, C/Hc, K)
    taps = (static + dynamic_taps.float()[:, :, None, :]).reshape(tokens, channels, width)
    return (windows.flip(-1) * taps).sum(-1)  # (T, C)


def dynamic_conv_varlen_ref(
    x: torch.Tensor,
    static_weight: torch.Tensor,
    dynamic_taps: torch.Tensor,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """The conv over packed sequences, each from its slot's history.

    Args:
        x: `(T, C)` inputs, sequences packed back to back.
        static_weight: `(K, C)` each channel's taps by lag.
        dynamic_taps: `(T, Hc, K)` each token's taps by head and lag.
        conv_states: `(S, C, K - 1)` float32; read where `has_initial_state`, then overwritten
            with each sequence's last `K - 1` inputs (padding and empty sequences' slots are
            left alone).
        query_start_loc: `(B + 1,)` int cumulative sequence starts.
        state_indices: `(B,)` each sequence's slot (`PAD_SLOT_ID`: skipped).
        has_initial_state: `(B,)` bool; False: the history is zeros.

    Returns:
        `(T, C)` float32 (zeros for tokens of no sequence).
    """
    hist = conv_states.shape[-1]
    xf = x.float()
    windows = x.new_zeros(x.shape[0], x.shape[1], hist + 1, dtype=torch.float32)  # (T, C, K)
    starts = query_start_loc.tolist()
    slots = state_indices.tolist()
    initial = has_initial_state.tolist()
    for seq, slot in enumerate(slots):
        begin, end = starts[seq], starts[seq + 1]
        if end == begin:
            continue
        chunk = xf[begin:end].T  # (C, n)
        history = chunk.new_zeros(chunk.shape[0], hist)
        if slot != PAD_SLOT_ID and initial[seq]:
            history = conv_states[slot].float()
        ext = torch.cat([history, chunk], dim=-1)  # (C, K - 1 + n)
        windows[begin:end] = ext.unfold(-1, hist + 1, 1).transpose(0, 1)  # (n, C, K)
        if slot != PAD_SLOT_ID:
            conv_states[slot] = ext[:, ext.shape[-1] - hist :].to(conv_states.dtype)
    return _apply_taps(windows, static_weight, dynamic_taps)


def dynamic_conv_update_ref(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    static_weight: torch.Tensor,
    dynamic_taps: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One new input per row: the conv over its saved history, which it then joins.

    Args:
        x: `(B, C)`; conv_states: `(S, C, K - 1)` float32, advanced in place at
            `state_indices`.
        static_weight, dynamic_taps: as `dynamic_conv_varlen_ref`'s (`dynamic_taps (B, Hc,
            K)`).
        state_indices: `(B,)` each row's slot (`PAD_SLOT_ID`: a zero history, nothing saved).

    Returns:
        `(B, C)` float32.
    """
    valid = state_indices != PAD_SLOT_ID  # (B,)
    index = state_indices.long().clamp(min=0)
    history = conv_states[index].float() * valid[:, None, None]  # (B, C, K - 1)
    windows = torch.cat([history, x.float()[:, :, None]], dim=-1)  # (B, C, K)
    if bool(valid.any()):
        conv_states[index[valid]] = windows[valid, :, 1:].to(conv_states.dtype)
    return _apply_taps(windows, static_weight, dynamic_taps)


class VarlenOp(Protocol):
    def __call__(
        self, x: Tensor, static_weight: Tensor, dynamic_taps: Tensor, conv_states: Tensor,
        query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    ) -> Tensor: ...  # fmt: skip


class UpdateOp(Protocol):
    def __call__(
        self, x: Tensor, conv_states: Tensor, static_weight: Tensor, dynamic_taps: Tensor,
        state_indices: Tensor,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    FAMILY,
    {
        "varlen": OpSpec(VarlenOp, dynamic_conv_varlen_ref),
        "update": OpSpec(UpdateOp, dynamic_conv_update_ref),
    },
)
