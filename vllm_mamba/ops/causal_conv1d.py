"""Causal depthwise conv1d over a flat varlen batch, and its one-token decode update.

Pure-PyTorch references (`*_ref`). The fast kernels (C++ on the CPU, Triton on CUDA) share
these signatures and are chosen in `vllm_mamba.ops.dispatch`.

Glossary:
    T: tokens in the flat batch; B: sequences; D: channels; K: conv kernel width;
    S: state slots. `conv_states` is `(S, D, K - 1)`: the last `K - 1` inputs of each slot.
    `query_start_loc` is `(B + 1,)`: sequence `b` owns tokens `[qsl[b], qsl[b + 1])`.
    A state index of `PAD_SLOT_ID` (-1) marks a padding row: it is neither read nor written.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.families import OpFamily, OpSpec

Tensor = torch.Tensor


def causal_conv1d_varlen_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: bool = True,
) -> torch.Tensor:
    """Causal conv1d over packed sequences, each starting from its slot's saved inputs.

    Args:
        x: `(T, D)` inputs, sequences packed back to back.
        weight: `(D, K)` depthwise filters.
        bias: `(D,)` or None.
        conv_states: `(S, D, K - 1)`; read where `has_initial_state`, then overwritten with
            each sequence's last `K - 1` inputs (slots of padding rows are left alone).
        query_start_loc: `(B + 1,)` int, cumulative sequence starts.
        state_indices: `(B,)` int slot per sequence, `PAD_SLOT_ID` for padding.
        has_initial_state: `(B,)` bool; False starts the sequence from zeros.
        activation: apply SiLU to the output.

    Returns:
        `(T, D)` outputs in the dtype of `x`.
    """
    num_tokens, dim = x.shape
    width = weight.shape[1]
    hist = width - 1
    batch = state_indices.shape[0]
    device = x.device
    qsl = query_start_loc.long()
    lens = qsl[1:] - qsl[:-1]  # (B,)
    seq_of_token = torch.repeat_interleave(torch.arange(batch, device=device), lens)  # (T,)
    valid = state_indices != PAD_SLOT_ID  # (B,)
    slots = state_indices.long().clamp(min=0)

    # ext holds, per sequence, K - 1 history rows followed by its tokens: (T + B * (K - 1), D).
    ext = x.new_zeros(num_tokens + batch * hist, dim, dtype=torch.float32)
    token_rows = torch.arange(num_tokens, device=device) + (seq_of_token + 1) * hist  # (T,)
    ext[token_rows] = x.float()
    if hist > 0:
        seq_base = qsl[:-1] + torch.arange(batch, device=device) * hist  # (B,)
        hist_rows = seq_base[:, None] + torch.arange(hist, device=device)  # (B, K-1)
        init = conv_states[slots].float().transpose(1, 2)  # (B, K-1, D)
        init = init * (has_initial_state & valid)[:, None, None]
        ext[hist_rows.reshape(-1)] = init.reshape(-1, dim)

    windows = token_rows[:, None] - hist + torch.arange(width, device=device)  # (T, K)
    out = torch.einsum("tkd,dk->td", ext[windows], weight.float())  # (T, D)
    if bias is not None:
        out = out + bias.float()
    if activation:
        out = F.silu(out)

    if hist > 0 and bool(valid.any()):
        seq_end = qsl[1:] + (torch.arange(batch, device=device) + 1) * hist  # (B,)
        last_rows = seq_end[:, None] - hist + torch.arange(hist, device=device)  # (B, K-1)
        new_states = ext[last_rows].transpose(1, 2)  # (B, D, K-1)
        conv_states[slots[valid]] = new_states[valid].to(conv_states.dtype)
    return out.to(x.dtype)


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: bool = True,
) -> torch.Tensor:
    """One new input per sequence: convolve with the saved history, then shift it in.

    Args:
        x: `(B, D)` the new input of each sequence.
        conv_states: `(S, D, K - 1)`, updated in place for the non-padding rows.
        weight: `(D, K)`; bias: `(D,)` or None.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.
        activation: apply SiLU to the output.

    Returns:
        `(B, D)` outputs (padding rows hold unspecified values).
    """
    valid = state_indices != PAD_SLOT_ID  # (B,)
    slots = state_indices.long().clamp(min=0)
    window = torch.cat([conv_states[slots].float(), x.float()[:, :, None]], dim=-1)  # (B, D, K)
    out = (window * weight.float()).sum(-1)  # (B, D)
    if bias is not None:
        out = out + bias.float()
    if activation:
        out = F.silu(out)
    if bool(valid.any()):
        conv_states[slots[valid]] = window[valid, :, 1:].to(conv_states.dtype)
    return out.to(x.dtype)


class ConvVarlenOp(Protocol):
    def __call__(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
        query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
        activation: bool = True,
    ) -> Tensor: ...  # fmt: skip


class ConvUpdateOp(Protocol):
    def __call__(
        self, x: Tensor, conv_states: Tensor, weight: Tensor, bias: Tensor | None,
        state_indices: Tensor, activation: bool = True,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    "causal_conv1d",
    {
        "varlen": OpSpec(ConvVarlenOp, causal_conv1d_varlen_ref),
        "update": OpSpec(ConvUpdateOp, causal_conv1d_update_ref),
    },
)
