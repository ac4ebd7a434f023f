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

import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.families import register_op_family

__all__ = ["FAMILY", "wkv7_varlen_ref", "wkv7_update_ref", "wkv7_step"]

FAMILY = "rwkv7"


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


register_op_family(FAMILY, {"varlen": wkv7_varlen_ref, "update": wkv7_update_ref})
