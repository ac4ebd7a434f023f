"""The mLSTM ops (xLSTM's matrix-memory cell) over a flat varlen batch (`varlen`) and one token
per row (`update`). Pure-PyTorch references (`*_ref`), registered as the op family `mlstm`
(`vllm_mamba.ops.families`); a backend registers faster versions under the same names and
signatures (`triton`: `vllm_mamba.ops.triton_mlstm`).

Per sequence and head the cell keeps a matrix memory `C (Dk, Dv)`, a normaliser `n (Dk,)` and a
stabiliser `m` (scalars are per head); the true state is `C exp(m)`, `n exp(m)`. Per token, with
`i`, `f` the (soft-capped) input and forget gate pre-activations and `s = Dk ** -0.5`:

    lf = logsigmoid(f)                      m' = max(lf + m, i)
    C = exp(lf + m - m') C + exp(i - m') k^T v
    n = exp(lf + m - m') n + exp(i - m') k
    h = (s q) C / (max(|(s q) . n|, exp(-m')) + eps)

(transformers' `mlstm_recurrent_step_native`). A sequence without a saved state starts from
zeros, `m` included (not minus infinity: `exp(-m)` bounds the denominator from the first
token on).

The references run a prompt in chunks of `chunk_size` tokens (transformers' chunkwise form,
exact for any chunk length): with `b_t` the cumulative sum of `lf` inside the chunk and
`(C0, n0, m0)` the state at its start, token t's stabiliser is
`m_t = max(b_t + m0, max_{j <= t} (b_t - b_j + i_j))` and, with `g_t = exp(b_t + m0 - m_t)`
and `d_tj = exp(b_t - b_j + i_j - m_t)`,

    num_t = g_t (s q_t) C0 + sum_{j <= t} d_tj (s q_t . k_j) v_j
    den_t = g_t (s q_t) . n0 + sum_{j <= t} d_tj (s q_t . k_j)
    h_t = num_t / (max(|den_t|, exp(-m_t)) + eps)

every exponent `<= 0`; the chunk's end state is the same sums at its last token, with
`k_j^T v_j` and `k_j`. Math is float32 whatever the inputs' dtype; outputs are in q's dtype.

Glossary (token-major layout):
    T: tokens; B: sequences (or decode rows); S: state slots; H: heads; Dk, Dv: query / key
    and value head dims; Q: chunk size.
    q, k: `(T, H, Dk)`; v: `(T, H, Dv)`; igate, fgate: `(T, H)`.
    c_states: `(S, H, Dk, Dv)`; n_states: `(S, H, Dk)`; m_states: `(S, H)` (float32 or
    bfloat16 C and n, math in float32). `query_start_loc` is `(B + 1,)`: sequence `b` owns
    tokens `[qsl[b], qsl[b + 1])`. A state index of `PAD_SLOT_ID` (-1) marks a padding row: its
    slot is neither read nor written, and its outputs are zeros.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.nn import functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.families import OpFamily, OpSpec

Tensor = torch.Tensor
State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # C (H, Dk, Dv), n (H, Dk), m (H,)

__all__ = ["CHUNK_SIZE", "EPS", "FAMILY", "mlstm_update_ref", "mlstm_varlen_ref"]

FAMILY = "mlstm"
CHUNK_SIZE = 64  # tokens per chunk of the reference's prefill (any length is exact)
EPS = 1e-6  # transformers' default `eps` of the denominator


def _chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    state: State,
    eps: float,
) -> tuple[torch.Tensor, State]:
    """One chunk of one sequence (float32).

    Args:
        q, k: `(H, n, Dk)` (q already scaled by `s`); v: `(H, n, Dv)`; i, f: `(H, n)`;
        state: `(C0, n0, m0)` before the first token; eps: the denominator's epsilon.

    Returns:
        `h (H, n, Dv)` and the state after the last token.
    """
    c0, n0, m0 = state
    b = F.logsigmoid(f).cumsum(-1)  # (H, n)
    causal = torch.ones(b.shape[-1], b.shape[-1], dtype=torch.bool, device=b.device).tril()
    log_d = (b[:, :, None] - b[:, None, :] + i[:, None, :]).masked_fill(~causal, -torch.inf)
    m = torch.maximum(b + m0[:, None], log_d.amax(-1))  # (H, n)
    scores = (q @ k.transpose(-1, -2)) * torch.exp(log_d - m[..., None])  # (H, n, n)
    inter = torch.exp(b + m0[:, None] - m)[..., None]  # (H, n, 1)
    num = inter * (q @ c0) + scores @ v  # (H, n, Dv)
    den = inter[..., 0] * (q @ n0[..., None])[..., 0] + scores.sum(-1)  # (H, n)
    h = num / (torch.maximum(den.abs(), torch.exp(-m)) + eps)[..., None]
    m_end = m[:, -1]  # (H,)
    w = torch.exp(b[:, -1:] - b + i - m_end[:, None])[..., None]  # (H, n, 1)
    g = torch.exp(b[:, -1] + m0 - m_end)  # (H,)
    c_end = g[:, None, None] * c0 + (k * w).transpose(-1, -2) @ v  # (H, Dk, Dv)
    n_end = g[:, None] * n0 + (k * w).sum(1)  # (H, Dk)
    return h, (c_end, n_end, m_end)


def _zero_state(c_states: torch.Tensor, n_states: torch.Tensor, m_states: torch.Tensor) -> State:
    """A fresh sequence's float32 state: zeros (`m` included)."""
    dev = c_states.device
    return (
        torch.zeros(c_states.shape[1:], dtype=torch.float32, device=dev),
        torch.zeros(n_states.shape[1:], dtype=torch.float32, device=dev),
        torch.zeros(m_states.shape[1:], dtype=torch.float32, device=dev),
    )


def mlstm_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    igate: torch.Tensor,
    fgate: torch.Tensor,
    c_states: torch.Tensor,
    n_states: torch.Tensor,
    m_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    eps: float = EPS,
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """The mLSTM over packed sequences, each from its slot's state (or zeros).

    Args:
        q, k: `(T, H, Dk)`; v: `(T, H, Dv)`; igate, fgate: `(T, H)` gate pre-activations.
        c_states, n_states, m_states: `(S, H, Dk, Dv)`, `(S, H, Dk)`, `(S, H)`; read where
            `has_initial_state`, then overwritten with each sequence's final state (padding
            rows are skipped; an empty fresh sequence leaves zeros).
        query_start_loc: `(B + 1,)` int32; state_indices: `(B,)` int32 slots, `PAD_SLOT_ID`
            rows skipped; has_initial_state: `(B,)` bool.
        eps: the denominator's epsilon (the config's `eps`).
        chunk_size: tokens per chunk (the result is the same for every chunk size, up to
            rounding).

    Returns:
        `(T, H, Dv)` in q's dtype (zeros for padding rows' tokens and tokens past `qsl[B]`).
    """
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    scale = q.shape[-1] ** -0.5
    starts = query_start_loc.tolist()
    for seq, slot in enumerate(state_indices.tolist()):
        lo, hi = starts[seq], starts[seq + 1]
        if slot == PAD_SLOT_ID:
            continue
        if bool(has_initial_state[seq]):
            state = (c_states[slot].float(), n_states[slot].float(), m_states[slot].float())
        else:
            state = _zero_state(c_states, n_states, m_states)
        for start in range(lo, hi, chunk_size):
            end = min(start + chunk_size, hi)
            qc, kc, vc = (t[start:end].float().transpose(0, 1) for t in (q, k, v))
            ic, fc = (t[start:end].float().T for t in (igate, fgate))  # (H, n)
            h, state = _chunk(qc * scale, kc, vc, ic, fc, state, eps)
            out[start:end] = h.transpose(0, 1)
        for dst, src in zip((c_states, n_states, m_states), state):
            dst[slot] = src.to(dst.dtype)
    return out.to(q.dtype)


def mlstm_update_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    igate: torch.Tensor,
    fgate: torch.Tensor,
    c_states: torch.Tensor,
    n_states: torch.Tensor,
    m_states: torch.Tensor,
    state_indices: torch.Tensor,
    eps: float = EPS,
) -> torch.Tensor:
    """Advances each row's slot state by one token, in place (decode: never a fresh state).

    Args:
        q, k: `(B, H, Dk)`; v: `(B, H, Dv)`; igate, fgate: `(B, H)`.
        c_states, n_states, m_states: as `mlstm_varlen_ref`'s, updated in place for the
            non-padding rows.
        state_indices: `(B,)` int32 slot per row, `PAD_SLOT_ID` rows skipped.
        eps: the denominator's epsilon.

    Returns:
        `(B, H, Dv)` in q's dtype (zeros for padding rows).
    """
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    slots = state_indices.long()
    live = slots != PAD_SLOT_ID
    if not bool(live.any()):
        return out.to(q.dtype)
    rows = slots[live]
    qs = q[live].float() * q.shape[-1] ** -0.5  # (L, H, Dk)
    kf, vf = k[live].float(), v[live].float()
    i, lf = igate[live].float(), F.logsigmoid(fgate[live].float())  # (L, H)
    m_old = m_states[rows].float()
    m = torch.maximum(lf + m_old, i)
    decay, gain = torch.exp(lf + m_old - m), torch.exp(i - m)  # (L, H)
    c = decay[..., None, None] * c_states[rows].float() + gain[..., None, None] * (
        kf[..., :, None] * vf[..., None, :]
    )  # (L, H, Dk, Dv)
    n = decay[..., None] * n_states[rows].float() + gain[..., None] * kf  # (L, H, Dk)
    num = torch.einsum("lhk,lhkv->lhv", qs, c)
    den = (qs * n).sum(-1)  # (L, H)
    out[live] = num / (torch.maximum(den.abs(), torch.exp(-m)) + eps)[..., None]
    for dst, src in zip((c_states, n_states, m_states), (c, n, m)):
        dst[rows] = src.to(dst.dtype)
    return out.to(q.dtype)


class VarlenOp(Protocol):
    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor, c_states: Tensor,
        n_states: Tensor, m_states: Tensor, query_start_loc: Tensor, state_indices: Tensor,
        has_initial_state: Tensor, eps: float = EPS, chunk_size: int = CHUNK_SIZE,
    ) -> Tensor: ...  # fmt: skip


class UpdateOp(Protocol):
    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor, c_states: Tensor,
        n_states: Tensor, m_states: Tensor, state_indices: Tensor, eps: float = EPS,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    FAMILY,
    {
        "varlen": OpSpec(VarlenOp, mlstm_varlen_ref),
        "update": OpSpec(UpdateOp, mlstm_update_ref),
    },
)
