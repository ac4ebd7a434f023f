"""RWKV's token shift over a step's flat batch: each row's previous token's input.

RWKV mixes every token's input `x_t` with the previous one's, `x_{t-1}` (time mix and channel
mix alike); a sequence's first token reads the value saved in its slot, `shift (S, C)` (the
last input of the previous chunk or decode step), or zeros for a fresh sequence. After the
step each slot holds its sequence's last input. The state is kind `conv` (kept in the model
dtype, like a conv history of width 2).

Rows come as the step lays them out (`MambaMetadata`): decode rows first (one token each, in
speculative waves when chains verify drafts: `run_decode_waves`), then the prefill chunks
back to back.

Glossary: T tokens in the step, C channels, S state slots, B prefill sequences.
"""

from __future__ import annotations

import torch

from vllm_mamba.attention.mamba_metadata import MambaMetadata, run_decode_waves
from vllm_mamba.cache_specs import PAD_SLOT_ID


def _decode_shift(x: torch.Tensor, shift: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`x (B, C)` one token per row: returns each slot's saved input (zeros for padding rows)
    and saves `x` in its place."""
    valid = slots != PAD_SLOT_ID  # (B,)
    idx = slots.long().clamp(min=0)
    prev = shift[idx] * valid[:, None].to(shift.dtype)  # (B, C)
    if bool(valid.all()):
        shift[idx] = x.to(shift.dtype)
    elif bool(valid.any()):
        shift[idx[valid]] = x[valid].to(shift.dtype)
    return prev.to(x.dtype)


def _prefill_shift(x: torch.Tensor, shift: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
    """`x (T, C)` the prefill chunks back to back: each token's previous input."""
    qsl = meta.prefill_query_start_loc.long()  # (B + 1,)
    starts, ends = qsl[:-1], qsl[1:]
    slots = meta.prefill_state_indices
    prev = torch.empty_like(x)  # (T, C)
    prev[1:] = x[:-1]
    valid = (slots != PAD_SLOT_ID) & (ends > starts)  # (B,)
    idx = slots.long().clamp(min=0)
    keep = (valid & meta.prefill_has_initial_state.bool())[:, None]
    nonempty = ends > starts
    first = torch.where(keep, shift[idx].to(x.dtype), torch.zeros((), dtype=x.dtype))  # (B, C)
    prev[starts[nonempty]] = first[nonempty]
    if bool(valid.any()):
        shift[idx[valid]] = x[ends[valid] - 1].to(shift.dtype)
    return prev


def token_shift(x: torch.Tensor, shift: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
    """Each row's previous token's input, advancing the saved inputs in place.

    Args:
        x: `(T, C)` the step's rows (decodes first, then the prefill chunks).
        shift: `(S, C)` every slot's last input.

    Returns:
        `(T, C)` in x's dtype.
    """
    nd = meta.num_decodes
    parts = []
    if nd:
        parts.append(
            run_decode_waves(
                meta, [shift], lambda rows, slots: _decode_shift(x[rows], shift, slots)
            )
        )
    if meta.num_prefills:
        parts.append(_prefill_shift(x[nd:], shift, meta))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
