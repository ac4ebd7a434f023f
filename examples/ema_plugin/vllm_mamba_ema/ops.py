"""The EMA mixer's two ops, pure PyTorch (`_ref` only): a varlen prefill scan and a decode update.

Per channel c, with `a = sigmoid(decay)` and lag weights `w (2, C)`:

    h_t = a * h_{t-1} + (1 - a) * u_t                       # state `ema (C,)`, float32
    m_t = h_t + w[0] * u_{t-1} + w[1] * u_{t-2}             # state `last (2, C)`: u_{t-1}, u_{t-2}

Both ops read and advance the states in place at the sequences' slots and skip rows whose
slot is `PAD_SLOT_ID` (their output is zero; no state is read or written).

Glossary: T tokens, B decode rows, P prefill chunks, S state slots, C channels, L chunk length.
"""

from __future__ import annotations

import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.families import register_op_family


def ema_state_update_ref(
    u: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    ema_state: torch.Tensor,
    last_state: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One token per sequence.

    Args:
        u: `(B, C)` inputs.
        a: `(C,)` float32 decay in (0, 1).
        w: `(2, C)` lag weights.
        ema_state: `(S, C)` float32, advanced in place.
        last_state: `(S, 2, C)`, rows `u_{t-1}`, `u_{t-2}`, advanced in place.
        state_indices: `(B,)` int32 slots (`PAD_SLOT_ID` rows skipped).

    Returns:
        `m (B, C)` in u's dtype.
    """
    out = torch.zeros_like(u)
    keep = state_indices != PAD_SLOT_ID  # (B,)
    if not bool(keep.any()):
        return out
    slots = state_indices[keep].long()
    uf = u[keep].float()  # (b, C)
    h = a * ema_state[slots] + (1 - a) * uf  # (b, C)
    last = last_state[slots].float()  # (b, 2, C)
    m = h + w[0].float() * last[:, 0] + w[1].float() * last[:, 1]
    ema_state[slots] = h
    last_state[slots] = torch.stack([uf, last[:, 0]], dim=1).to(last_state.dtype)
    out[keep] = m.to(u.dtype)
    return out


def ema_scan_varlen_ref(
    u: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    ema_state: torch.Tensor,
    last_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """Prefill chunks packed in one batch, each from its saved state or from zeros.

    Within a chunk the scan is closed-form: `h_t = a^(t+1) h0 + sum_{s<=t} (1-a) a^(t-s) u_s`,
    the powers taken as `exp((t - s) log a)` so long chunks neither underflow nor overflow.

    Args:
        u: `(T, C)` the chunks' inputs, back to back.
        a: `(C,)` float32 decay in (0, 1).
        w: `(2, C)` lag weights.
        ema_state: `(S, C)` float32; read where `has_initial_state`, written with the state
            after each chunk's last token.
        last_state: `(S, 2, C)`, likewise.
        query_start_loc: `(P + 1,)` int32 chunk boundaries in `u`.
        state_indices: `(P,)` int32 slots (`PAD_SLOT_ID` chunks skipped).
        has_initial_state: `(P,)` bool.

    Returns:
        `m (T, C)` in u's dtype.
    """
    out = torch.zeros_like(u)
    log_a = torch.log(a)  # (C,)
    bounds = query_start_loc.tolist()
    for i, slot in enumerate(state_indices.tolist()):
        start, end = bounds[i], bounds[i + 1]
        if slot == PAD_SLOT_ID or end == start:
            continue
        uf = u[start:end].float()  # (L, C)
        n = end - start
        if bool(has_initial_state[i]):
            h0, last = ema_state[slot].float(), last_state[slot].float()  # (C,), (2, C)
        else:
            h0, last = uf.new_zeros(uf.shape[1]), uf.new_zeros(2, uf.shape[1])
        t = torch.arange(n, dtype=torch.float32, device=u.device)
        lag = (t[:, None] - t[None, :]).clamp(min=0)  # (L, L)
        weights = torch.exp(lag[..., None] * log_a) * (1 - a)  # (L, L, C)
        weights = weights * torch.tril(torch.ones(n, n, device=u.device))[..., None]
        h = torch.einsum("tsc,sc->tc", weights, uf)  # (L, C)
        h = h + torch.exp((t[:, None] + 1) * log_a) * h0  # (L, C)
        history = torch.cat([last.flip(0), uf])  # (L + 2, C): u_{-2}, u_{-1}, u_0, ...
        m = h + w[0].float() * history[1:-1] + w[1].float() * history[:-2]
        out[start:end] = m.to(u.dtype)
        ema_state[slot] = h[-1]
        last_state[slot] = history[-2:].flip(0).to(last_state.dtype)  # u_{L-1}, u_{L-2}
    return out


OP_FAMILY = "ema"
# The family's ops, as the mixer calls them (`MambaOps.family`); a backend with faster versions
# would add them with `register_op_impl(OP_FAMILY, backend, ...)`.
register_op_family(
    OP_FAMILY, {"scan_varlen": ema_scan_varlen_ref, "state_update": ema_state_update_ref}
)
