"""The recurrent parts of Compressed Convolutional Attention (CCA, ZAYA1) as one op family,
`cca`: the two causal convs over the compressed queries and keys, and the one-token delay of
the delayed value half, each over a flat varlen batch (`conv_varlen`, `shift_varlen`) and one
token per row (`conv_update`, `shift_update`). Pure-PyTorch references (`*_ref`), registered
as the op family `cca` (`vllm_mamba.ops.families`); a backend registers faster versions under
the same names and signatures.

The conv is transformers' pair of `nn.Conv1d`s without padding over a sequence's inputs with
its `K - 1 = (K0 - 1) + (K1 - 1)` previous ones in front: a depthwise conv of width `K0`, then
a grouped conv of width `K1` whose group `g` (one per query or key head, `D` channels) mixes
the group's channels, both with biases:

    y[t, j, c] = dw_bias[c] + sum_{a < K0} dw_weight[c, a] x[t - K + 1 + j + a, c]     (j < K1)
    out[t, gD + o] = g_bias[gD + o] + sum_{d < D, j < K1} g_weight[gD + o, d, j] y[t, j, gD + d]

A sequence's inputs before its first token are its slot's saved history `conv (S, C, K - 1)`
(its last `K - 1` inputs), or zeros for a fresh sequence (transformers' zero padding: the
depthwise biases still reach the grouped conv); after the step each slot holds its sequence's
last `K - 1` inputs (history rows among them when the chunk is shorter).

The shift: each token's output is the previous token's input, a sequence's first token reading
its slot's saved input `shift (S, V)`, or `initial` for a fresh sequence (the delayed
projection of a zero input: its bias); after the step each slot holds its sequence's last input.

The convs compute in x's dtype (the weights' too), each rounded as transformers' `nn.Conv1d`s
round; the shift only moves values.

Glossary:
    T: tokens in the flat batch; B: sequences (or decode rows); C: conv channels (`G D`);
    G: groups (heads); D: channels per group (head dim); K0, K1: the two convs' widths,
    K = K0 + K1 - 1; V: shifted channels; S: state slots. `query_start_loc` is `(B + 1,)`:
    sequence `b` owns tokens `[qsl[b], qsl[b + 1])`. A state index of `PAD_SLOT_ID` (-1) marks
    a padding row: its slot is neither read nor written.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.nn import functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.families import OpFamily, OpSpec

Tensor = torch.Tensor
FAMILY = "cca"


def _convs(
    seqs: torch.Tensor,
    dw_weight: torch.Tensor,
    dw_bias: torch.Tensor,
    g_weight: torch.Tensor,
    g_bias: torch.Tensor,
) -> torch.Tensor:
    """Both convs without padding over `seqs (B, C, L)` -> `(B, C, L - K + 1)`: output `i`
    of a row reads its inputs `i .. i + K - 1`."""
    channels = seqs.shape[1]
    y = F.conv1d(seqs, dw_weight[:, None, :], dw_bias, groups=channels)  # (B, C, L - K0 + 1)
    return F.conv1d(y, g_weight, g_bias, groups=channels // g_weight.shape[1])


def _window_convs(
    window: torch.Tensor,
    dw_weight: torch.Tensor,
    dw_bias: torch.Tensor,
    g_weight: torch.Tensor,
    g_bias: torch.Tensor,
) -> torch.Tensor:
    """Both convs over each row's last `K` inputs `window (B, C, K)` -> `(B, C)`, as a few
    products (`F.conv1d` on a window this short costs more than the math)."""
    rows, channels, width = window.shape
    taps, inner = g_weight.shape[2], g_weight.shape[1]  # K1, D
    groups = channels // inner
    terms = [window[:, :, a : a + taps] * dw_weight[:, a, None] for a in range(width - taps + 1)]
    y = dw_bias[:, None] + sum(terms)  # (B, C, K1): the depthwise outputs the grouped conv reads
    per_group = y.view(rows, groups, inner * taps).transpose(0, 1)  # (G, B, D K1)
    mixed = g_weight.view(groups, inner, inner * taps)  # (G, D out, D in K1)
    out = torch.baddbmm(g_bias.view(groups, 1, inner), per_group, mixed.transpose(1, 2))
    return out.transpose(0, 1).reshape(rows, channels)  # (G, B, D) -> (B, C)


def cca_conv_varlen_ref(
    x: torch.Tensor,
    dw_weight: torch.Tensor,
    dw_bias: torch.Tensor,
    g_weight: torch.Tensor,
    g_bias: torch.Tensor,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """Both convs over packed sequences, each from its slot's history.

    Args:
        x: `(T, C)` inputs, sequences packed back to back.
        dw_weight: `(C, K0)` depthwise filters; dw_bias: `(C,)`.
        g_weight: `(C, D, K1)` grouped filters (`nn.Conv1d`'s layout); g_bias: `(C,)`.
        conv_states: `(S, C, K - 1)`; read where `has_initial_state`, then overwritten with
            each sequence's last `K - 1` inputs (padding sequences' slots are left alone).
        query_start_loc: `(B + 1,)` int cumulative sequence starts.
        state_indices: `(B,)` each sequence's slot (`PAD_SLOT_ID`: skipped).
        has_initial_state: `(B,)` bool; False: the history is zeros.

    Returns:
        `(T, C)` in x's dtype.
    """
    num_tokens, channels = x.shape
    hist = conv_states.shape[-1]
    batch = state_indices.shape[0]
    device = x.device
    qsl = query_start_loc.long()
    seq = torch.arange(batch, device=device)
    seq_of_token = torch.repeat_interleave(seq, qsl[1:] - qsl[:-1], output_size=num_tokens)
    valid = state_indices != PAD_SLOT_ID  # (B,)
    slots = state_indices.long().clamp(min=0)
    # Per sequence, its K - 1 history rows then its tokens: (T + B (K - 1), C).
    ext = x.new_zeros(num_tokens + batch * hist, channels)
    token_rows = torch.arange(num_tokens, device=device) + (seq_of_token + 1) * hist  # (T,)
    ext[token_rows] = x
    hist_rows = (qsl[:-1] + seq * hist)[:, None] + torch.arange(hist, device=device)  # (B, K-1)
    saved = conv_states[slots].transpose(1, 2).to(x.dtype)  # (B, K - 1, C)
    keep = (has_initial_state.bool() & valid)[:, None, None]
    ext[hist_rows.flatten()] = torch.where(keep, saved, 0).flatten(0, 1)
    # Over the whole buffer, `(T + B (K - 1) - K + 1, C)`: the rows whose inputs span two
    # sequences are computed and never read.
    out = _convs(ext.T[None], dw_weight, dw_bias, g_weight, g_bias)[0].T
    if bool(valid.any()):
        last = (qsl[1:] + seq * hist)[:, None] + torch.arange(hist, device=device)  # (B, K-1)
        kept = ext[last].transpose(1, 2)  # (B, C, K - 1)
        conv_states[slots[valid]] = kept[valid].to(conv_states.dtype)
    return out[token_rows - hist]


def cca_conv_update_ref(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    dw_weight: torch.Tensor,
    dw_bias: torch.Tensor,
    g_weight: torch.Tensor,
    g_bias: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One new input per row: both convs over its saved history, then shifted in.

    Args:
        x: `(B, C)`; conv_states: `(S, C, K - 1)`, advanced in place at `state_indices`.
        dw_weight, dw_bias, g_weight, g_bias: as `cca_conv_varlen_ref`'s.
        state_indices: `(B,)` each row's slot (`PAD_SLOT_ID`: skipped, unspecified output).

    Returns:
        `(B, C)` in x's dtype.
    """
    valid = state_indices != PAD_SLOT_ID  # (B,)
    slots = state_indices.long().clamp(min=0)
    saved = conv_states[slots].to(x.dtype)  # (B, C, K - 1)
    window = torch.cat([saved, x[:, :, None]], dim=-1)  # (B, C, K)
    out = _window_convs(window, dw_weight, dw_bias, g_weight, g_bias)  # (B, C)
    if bool(valid.any()):
        conv_states[slots[valid]] = window[valid, :, 1:].to(conv_states.dtype)
    return out


def cca_shift_varlen_ref(
    x: torch.Tensor,
    shift_states: torch.Tensor,
    initial: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """Each token's previous input over packed sequences.

    Args:
        x: `(T, V)` inputs, sequences packed back to back.
        shift_states: `(S, V)`; read where `has_initial_state`, then overwritten with each
            sequence's last input (padding and empty sequences' slots are left alone).
        initial: `(V,)` the first token's previous input without a saved one (None: zeros).
        query_start_loc, state_indices, has_initial_state: as `cca_conv_varlen_ref`'s.

    Returns:
        `(T, V)` in x's dtype.
    """
    qsl = query_start_loc.long()
    starts, ends = qsl[:-1], qsl[1:]
    prev = torch.empty_like(x)
    prev[1:] = x[:-1]
    nonempty = ends > starts
    valid = (state_indices != PAD_SLOT_ID) & nonempty  # (B,)
    slots = state_indices.long().clamp(min=0)
    fresh = x.new_zeros(x.shape[1]) if initial is None else initial.to(x.dtype)
    saved = (valid & has_initial_state.bool())[:, None]  # (B, 1)
    first = torch.where(saved, shift_states[slots].to(x.dtype), fresh)  # (B, V)
    prev[starts[nonempty]] = first[nonempty]
    if bool(valid.any()):
        shift_states[slots[valid]] = x[ends[valid] - 1].to(shift_states.dtype)
    return prev


def cca_shift_update_ref(
    x: torch.Tensor, shift_states: torch.Tensor, state_indices: torch.Tensor
) -> torch.Tensor:
    """One new input per row: returns its slot's saved input and saves the new one.

    Args:
        x: `(B, V)`; shift_states: `(S, V)`, advanced in place at `state_indices`.
        state_indices: `(B,)` each row's slot (`PAD_SLOT_ID`: skipped, unspecified output).

    Returns:
        `(B, V)` in x's dtype.
    """
    valid = state_indices != PAD_SLOT_ID  # (B,)
    slots = state_indices.long().clamp(min=0)
    prev = shift_states[slots].to(x.dtype)  # (B, V)
    if bool(valid.any()):
        shift_states[slots[valid]] = x[valid].to(shift_states.dtype)
    return prev


class ConvVarlenOp(Protocol):
    def __call__(
        self, x: Tensor, dw_weight: Tensor, dw_bias: Tensor, g_weight: Tensor, g_bias: Tensor,
        conv_states: Tensor, query_start_loc: Tensor, state_indices: Tensor,
        has_initial_state: Tensor,
    ) -> Tensor: ...  # fmt: skip


class ConvUpdateOp(Protocol):
    def __call__(
        self, x: Tensor, conv_states: Tensor, dw_weight: Tensor, dw_bias: Tensor,
        g_weight: Tensor, g_bias: Tensor, state_indices: Tensor,
    ) -> Tensor: ...  # fmt: skip


class ShiftVarlenOp(Protocol):
    def __call__(
        self, x: Tensor, shift_states: Tensor, initial: Tensor | None, query_start_loc: Tensor,
        state_indices: Tensor, has_initial_state: Tensor,
    ) -> Tensor: ...  # fmt: skip


class ShiftUpdateOp(Protocol):
    def __call__(self, x: Tensor, shift_states: Tensor, state_indices: Tensor) -> Tensor: ...


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    FAMILY,
    {
        "conv_varlen": OpSpec(ConvVarlenOp, cca_conv_varlen_ref),
        "conv_update": OpSpec(ConvUpdateOp, cca_conv_update_ref),
        "shift_varlen": OpSpec(ShiftVarlenOp, cca_shift_varlen_ref),
        "shift_update": OpSpec(ShiftUpdateOp, cca_shift_update_ref),
    },
)
