"""Mamba's selective scan over a flat varlen batch, and its one-token state update.

Pure-PyTorch references (`*_ref`). The fast kernels share these signatures and are chosen in
`vllm_mamba.ops.dispatch`.

Glossary (token-major layout):
    T: tokens; B: sequences; D: channels (intermediate size); N: state size; S: state slots.
    u: `(T, D)` input; dt: `(T, D)` time step before bias and softplus; A: `(D, N)`;
    B_, C: `(T, N)` input-dependent projections; D_skip: `(D,)`; z: `(T, D)` gate.
    ssm_states: `(S, D, N)` per-slot recurrent state, always updated in float32 math.
    The recurrence per token is h = exp(dt * A) * h + (dt * B) * u, y = h @ C + D * u,
    out = y * silu(z).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.discretize import discretize_dt
from vllm_mamba.ops.families import OpFamily, OpSpec

Tensor = torch.Tensor


def _gate_and_skip(
    y: torch.Tensor, u: torch.Tensor, D_skip: torch.Tensor | None, z: torch.Tensor | None
) -> torch.Tensor:
    """y + D * u, then times silu(z); all float32."""
    if D_skip is not None:
        y = y + u.float() * D_skip.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y


def selective_scan_varlen_ref(
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B_: torch.Tensor,
    C: torch.Tensor,
    D_skip: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """Scans packed sequences, each from its slot's state (or zeros), and saves the final state.

    Args:
        u, dt, z: `(T, D)`; A: `(D, N)`; B_, C: `(T, N)`; D_skip, dt_bias: `(D,)` or None.
        dt_softplus: apply softplus to `dt + dt_bias`.
        ssm_states: `(S, D, N)`, read where `has_initial_state`, then overwritten with each
            sequence's final state (padding rows are skipped).
        query_start_loc: `(B + 1,)`; state_indices: `(B,)`; has_initial_state: `(B,)` bool.

    Returns:
        `(T, D)` outputs in the dtype of `u`.
    """
    num_tokens, dim = u.shape
    batch = state_indices.shape[0]
    device = u.device
    qsl = query_start_loc.long()
    lens = qsl[1:] - qsl[:-1]  # (B,)
    max_len = int(lens.max()) if batch > 0 else 0
    valid = state_indices != PAD_SLOT_ID
    slots = state_indices.long().clamp(min=0)

    pos = torch.arange(max_len, device=device)  # (L,)
    in_seq = pos[None, :] < lens[:, None]  # (B, L)
    tok = (qsl[:-1, None] + pos[None, :]).clamp(max=max(num_tokens - 1, 0))  # (B, L)

    delta = discretize_dt(dt, dt_bias, dt_softplus)  # (T, D)
    A = A.float()
    state = ssm_states[slots].float() * (has_initial_state & valid)[:, None, None]  # (B, D, N)
    y = torch.zeros(num_tokens, dim, dtype=torch.float32, device=device)
    uf, Bf, Cf = u.float(), B_.float(), C.float()
    for p in range(max_len):
        rows = tok[:, p]  # (B,)
        live = in_seq[:, p, None, None]  # (B, 1, 1)
        d = delta[rows]  # (B, D)
        dA = torch.exp(A[None] * d[:, :, None])  # (B, D, N)
        dBu = (d[:, :, None] * Bf[rows][:, None, :]) * uf[rows][:, :, None]  # (B, D, N)
        state = torch.where(live, dA * state + dBu, state)
        yp = torch.matmul(state, Cf[rows][:, :, None])[:, :, 0]  # (B, D)
        y[rows[in_seq[:, p]]] = yp[in_seq[:, p]]

    if bool(valid.any()):
        ssm_states[slots[valid]] = state[valid].to(ssm_states.dtype)
    return _gate_and_skip(y, u, D_skip, z).to(u.dtype)


def selective_state_update_ref(
    ssm_states: torch.Tensor,
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B_: torch.Tensor,
    C: torch.Tensor,
    D_skip: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """Advances each row's slot state by one token, in place.

    Args:
        ssm_states: `(S, D, N)`, updated in place for non-padding rows.
        u, dt, z: `(B, D)`; A: `(D, N)`; B_, C: `(B, N)`; D_skip, dt_bias: `(D,)` or None.
        dt_softplus: apply softplus to `dt + dt_bias`.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.

    Returns:
        `(B, D)` outputs in the dtype of `u` (padding rows hold unspecified values).
    """
    valid = state_indices != PAD_SLOT_ID
    slots = state_indices.long().clamp(min=0)
    delta = discretize_dt(dt, dt_bias, dt_softplus)  # (B, D)
    dA = torch.exp(delta[:, :, None] * A.float())  # (B, D, N)
    dBu = (delta[:, :, None] * B_.float()[:, None, :]) * u.float()[:, :, None]  # (B, D, N)
    state = ssm_states[slots].float() * dA + dBu  # (B, D, N)
    if bool(valid.any()):
        ssm_states[slots[valid]] = state[valid].to(ssm_states.dtype)
    y = torch.matmul(state, C.float()[:, :, None])[:, :, 0]  # (B, D)
    return _gate_and_skip(y, u, D_skip, z).to(u.dtype)


class ScanVarlenOp(Protocol):
    def __call__(
        self, u: Tensor, dt: Tensor, A: Tensor, B_: Tensor, C: Tensor, D_skip: Tensor | None,
        z: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool, ssm_states: Tensor,
        query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    ) -> Tensor: ...  # fmt: skip


class ScanUpdateOp(Protocol):
    def __call__(
        self, ssm_states: Tensor, u: Tensor, dt: Tensor, A: Tensor, B_: Tensor, C: Tensor,
        D_skip: Tensor | None, z: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool,
        state_indices: Tensor,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    "selective_scan",
    {
        "varlen": OpSpec(ScanVarlenOp, selective_scan_varlen_ref),
        "update": OpSpec(ScanUpdateOp, selective_state_update_ref),
    },
)
