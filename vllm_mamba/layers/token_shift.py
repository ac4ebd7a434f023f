"""RWKV's token shift over a step's flat batch: each row's input mixed with the previous token's.

RWKV mixes every token's input `x_t` with the previous one's, `x_{t-1}`, by learned per-channel
weights (`x + (x_{t-1} - x) * mu`; the time mix has six such mixes, the channel mix one); a
sequence's first token reads the value saved in its slot, `shift (S, C)` (the last input of the
previous chunk or decode step), or zeros for a fresh sequence. After the step each slot holds
its sequence's last input. The state is kind `conv` (kept in the model dtype, like a conv
history of width 2).

Rows come as the step lays them out (`MambaMetadata`): decode rows first (one token each, in
speculative waves when chains verify drafts), run by the op family's `shift_mix`
(`vllm_mamba.ops.rwkv7`, fused in C++), then the prefill chunks back to back; `recurrent_step`
runs the split.

Glossary: T tokens in the step, C channels, S state slots, B prefill sequences, M mixes.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.layers.recurrent_step import recurrent_step


def _prefill_shift(x: torch.Tensor, shift: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
    """`x (T, C)` the prefill chunks back to back: each token's previous input `(T, C)`,
    advancing the slots' saved inputs."""
    qsl = meta.prefill_query_start_loc.long()  # (B + 1,)
    starts, ends = qsl[:-1], qsl[1:]
    slots = meta.prefill_state_indices
    prev = torch.empty_like(x)  # (T, C)
    prev[1:] = x[:-1]
    nonempty = ends > starts
    valid = (slots != PAD_SLOT_ID) & nonempty  # (B,)
    idx = slots.long().clamp(min=0)
    keep = (valid & meta.prefill_has_initial_state.bool())[:, None]
    first = torch.where(keep, shift[idx].to(x.dtype), torch.zeros((), dtype=x.dtype))  # (B, C)
    prev[starts[nonempty]] = first[nonempty]
    if bool(valid.any()):
        shift[idx[valid]] = x[ends[valid] - 1].to(shift.dtype)
    return prev


def shift_mix(
    x: torch.Tensor,
    shift: torch.Tensor,
    mixes: torch.Tensor,
    meta: MambaMetadata,
    ops: SimpleNamespace,
) -> torch.Tensor:
    """`x + (x' - x) * mixes[m]` for every row and mix, advancing the saved inputs in place.

    Args:
        x: `(T, C)` the step's rows (decodes first, then the prefill chunks).
        shift: `(S, C)` every slot's last input.
        mixes: `(M, 1, C)`.
        ops: the `rwkv7` op family (its `shift_mix` runs the decode rows).

    Returns:
        `(M, T, C)` in x's dtype.
    """

    def prefill(rows: slice) -> torch.Tensor:
        xp = x[rows]  # (prefill tokens, C)
        return torch.addcmul(xp, _prefill_shift(xp, shift, meta) - xp, mixes)

    return recurrent_step(
        meta, [shift], decode=lambda rows, slots: ops.shift_mix(x[rows], shift, slots, mixes),
        prefill=prefill, dim=1,
    )  # fmt: skip
