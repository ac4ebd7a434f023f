"""The RWKV-4 WKV ops: the max-stabilised weighted average over a flat varlen batch and its
one-token update. Pure-PyTorch references (`*_ref`), registered as the op family `rwkv4`
(`vllm_mamba.ops.families`); a backend registers faster versions under the same names and
signatures (`cpp`: `csrc/rwkv.cpp`, `triton`: `vllm_mamba.ops.triton_rwkv`).

Per token and channel, with `w = -exp(time_decay)` (< 0), `u = time_first` and the state
`(num, den, max)` (the numerator and the denominator divided by `exp(max)`):

    q = max(max, u + k)                                     the output, with this token's bonus
    wkv = (exp(max - q) num + exp(u + k - q) v) / (exp(max - q) den + exp(u + k - q))
    p = max(max + w, k)                                     the state, decayed, then this token
    num = exp(max + w - p) num + exp(k - p) v
    den = exp(max + w - p) den + exp(k - p)
    max = p

as transformers' `rwkv_linear_attention_cpu`. A fresh state is `(0, 0, -1e38)` (`MAX_INIT`).
Math is float32; the output is rounded once to v's dtype; the three state tensors are float32.

Glossary: T tokens in the flat batch; B sequences (or decode rows); S state slots; C channels
(`attention_hidden_size`). `query_start_loc (B + 1,)`: sequence `b` owns tokens
`[qsl[b], qsl[b + 1])`. A state index of `PAD_SLOT_ID` (-1) marks a padding row: its slot is
neither read nor written, and its outputs are those of a fresh state.
"""

from __future__ import annotations

from typing import Protocol

import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.families import OpFamily, OpSpec

Tensor = torch.Tensor

__all__ = ["FAMILY", "MAX_INIT", "wkv4_varlen_ref", "wkv4_update_ref", "wkv4_step"]

FAMILY = "rwkv4"
MAX_INIT = -1e38  # the running maximum of a fresh state, as transformers'


def wkv4_step(
    num: torch.Tensor,
    den: torch.Tensor,
    mx: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token for a batch of independent float32 states `(..., C)`; returns
    `(wkv, num, den, max)`."""
    q = torch.maximum(mx, u + k)
    e1, e2 = torch.exp(mx - q), torch.exp(u + k - q)
    wkv = (e1 * num + e2 * v) / (e1 * den + e2)
    p = torch.maximum(mx + w, k)
    e1, e2 = torch.exp(mx + w - p), torch.exp(k - p)
    return wkv, e1 * num + e2 * v, e1 * den + e2, p


def wkv4_varlen_ref(
    w: torch.Tensor,
    u: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_states: torch.Tensor,
    den_states: torch.Tensor,
    max_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """The WKV over packed sequences, each from its slot's saved state.

    Args:
        w: `(C,)` float32 `-exp(time_decay)`; u: `(C,)` `time_first`;
        k, v: `(T, C)`;
        num_states, den_states, max_states: `(S, C)` float32; read where `has_initial_state`,
            then overwritten with each sequence's final state (padding slots untouched).
        query_start_loc: `(B + 1,)`; state_indices: `(B,)`; has_initial_state: `(B,)` bool.

    Returns:
        `(T, C)` in v's dtype.
    """
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    w32, u32, kf, vf = w.float(), u.float(), k.float(), v.float()
    bounds = query_start_loc.tolist()
    for seq, slot in enumerate(state_indices.tolist()):
        start, end = bounds[seq], bounds[seq + 1]
        valid = slot != PAD_SLOT_ID
        if valid and bool(has_initial_state[seq]):
            num, den, mx = (s[slot].float() for s in (num_states, den_states, max_states))
        else:
            num, den = torch.zeros_like(w32), torch.zeros_like(w32)
            mx = torch.full_like(w32, MAX_INIT)
        for t in range(start, end):
            out[t], num, den, mx = wkv4_step(num, den, mx, w32, u32, kf[t], vf[t])
        if valid:
            num_states[slot], den_states[slot], max_states[slot] = num, den, mx
    return out.to(v.dtype)


def wkv4_update_ref(
    w: torch.Tensor,
    u: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_states: torch.Tensor,
    den_states: torch.Tensor,
    max_states: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One token per row, the states advanced in place.

    Args:
        w, u: `(C,)`; k, v: `(B, C)`; the states `(S, C)` float32; state_indices: `(B,)`.

    Returns:
        `(B, C)` in v's dtype (padding rows: the output of a fresh state).
    """
    valid = state_indices != PAD_SLOT_ID  # (B,)
    slots = state_indices.long().clamp(min=0)
    keep = valid[:, None]
    num = torch.where(keep, num_states[slots], 0.0)
    den = torch.where(keep, den_states[slots], 0.0)
    mx = torch.where(keep, max_states[slots], MAX_INIT)
    wkv, num, den, mx = wkv4_step(num, den, mx, w.float(), u.float(), k.float(), v.float())
    if bool(valid.any()):
        rows = slots[valid]
        num_states[rows], den_states[rows], max_states[rows] = num[valid], den[valid], mx[valid]
    return wkv.to(v.dtype)


class VarlenOp(Protocol):
    def __call__(
        self, w: Tensor, u: Tensor, k: Tensor, v: Tensor, num_states: Tensor, den_states: Tensor,
        max_states: Tensor, query_start_loc: Tensor, state_indices: Tensor,
        has_initial_state: Tensor,
    ) -> Tensor: ...  # fmt: skip


class UpdateOp(Protocol):
    def __call__(
        self, w: Tensor, u: Tensor, k: Tensor, v: Tensor, num_states: Tensor, den_states: Tensor,
        max_states: Tensor, state_indices: Tensor,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    FAMILY,
    {
        "varlen": OpSpec(VarlenOp, wkv4_varlen_ref),
        "update": OpSpec(UpdateOp, wkv4_update_ref),
    },
)
