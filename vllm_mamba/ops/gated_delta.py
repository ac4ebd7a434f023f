"""The Gated DeltaNet (GDN) ops: the gated delta rule over a flat varlen batch, its one-token
update, and the per-head gated RMSNorm of its output. Pure-PyTorch references (`*_ref`),
registered as the op family `gated_delta` (`vllm_mamba.ops.families`); a backend registers
faster versions under the same names and signatures.

Glossary (token-major layout):
    T: tokens; B: sequences (or decode rows); S: state slots; Hk: key heads; Hv: value heads
    (a multiple of Hk: value head `h` reads key head `h // (Hv / Hk)`); Dk, Dv: key and value
    head dims; Q: chunk size.
    q, k: `(T, Hk, Dk)` after the conv, before their L2 normalisation; v: `(T, Hv, Dv)`;
    a, b: `(T, Hv)` the decay and beta projections; A_log, dt_bias: `(Hv,)`.
    ssm_states: `(S, Hv, Dk, Dv)` per-slot state (float32 or bfloat16, math in float32).

Per token and value head, with q and k L2-normalised (eps 1e-6) and q scaled by `Dk ** -0.5`:

    g = -exp(A_log) * softplus(a + dt_bias)        beta = beta_scale * sigmoid(b)
    S = exp(g) S + k (beta (v - exp(g) S^T k))^T   o = S^T q

(`beta_scale` is 2 for OLMo Hybrid's `allow_neg_eigval`, else 1.) The chunked form cuts each
sequence into chunks of Q tokens from its first token. Inside a chunk, with `c` the cumulative
log decay and `S0` the state at the chunk's start, the new values `U` solve the unit lower
triangular system `(I + A) U = beta V - (beta exp(c) K) S0`, `A[i, j] = beta_i exp(c_i - c_j)
k_i . k_j` for `j < i`; then `o_i = exp(c_i) S0^T q_i + sum_{j <= i} exp(c_i - c_j)
(q_i . k_j) u_j` and the state at the chunk's end is `exp(c_Q) S0 + sum_j exp(c_Q - c_j) k_j
u_j^T`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.families import OpFamily, OpSpec

Tensor = torch.Tensor

FAMILY = "gated_delta"
L2_EPS = 1e-6


def gdn_gates_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    beta_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`a, b (T, Hv)` -> float32 log decay `g (T, Hv)` and `beta (T, Hv)` (see the module)."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    return g, beta * beta_scale if beta_scale != 1.0 else beta


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """L2-normalises the last dimension of float32 `x`, as FLA does (`x / sqrt(|x|^2 + eps)`)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _heads_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, ...]:
    """`q, k (..., Hk, Dk)` -> normalised float32 `(..., Hv, Dk)`, q scaled by `Dk ** -0.5`."""
    rep = num_v_heads // q.shape[-2]
    qf = _l2norm(q.float()) * q.shape[-1] ** -0.5
    kf = _l2norm(k.float())
    if rep != 1:
        qf, kf = qf.repeat_interleave(rep, dim=-2), kf.repeat_interleave(rep, dim=-2)
    return qf, kf


def _chunk_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule over one sequence (float32, prepared heads).

    Args:
        q, k: `(L, Hv, Dk)` normalised (q scaled); v: `(L, Hv, Dv)`; g, beta: `(L, Hv)`.
        state: `(Hv, Dk, Dv)` before the first token.
        chunk_size: Q.

    Returns:
        `o (L, Hv, Dv)` and the state after the last token `(Hv, Dk, Dv)`.
    """
    length = q.shape[0]
    pad = (-length) % chunk_size  # zero padding: g = 0 and beta = 0 leave the state unchanged

    def chunked(t: torch.Tensor) -> torch.Tensor:  # (L, Hv, *D) -> (Hv, n, Q, *D)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, 0, 0, pad))
        t = t.reshape(-1, chunk_size, *t.shape[1:])
        return t.movedim(2, 0)

    qc, kc, vc = chunked(q), chunked(k), chunked(v)  # (Hv, n, Q, D)
    gc, bc = chunked(g), chunked(beta)  # (Hv, n, Q)
    cum = gc.cumsum(-1)  # (Hv, n, Q)
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kk = kc @ kc.transpose(-1, -2)  # (Hv, n, Q, Q)
    system = (bc[..., None] * kk * decay).tril(-1) + torch.eye(chunk_size, device=q.device)
    rhs_v = bc[..., None] * vc  # (Hv, n, Q, Dv)
    rhs_k = (bc * cum.exp())[..., None] * kc  # (Hv, n, Q, Dk)
    u_v = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
    u_k = torch.linalg.solve_triangular(system, rhs_k, upper=False, unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * decay  # (Hv, n, Q, Q), causal
    q_start = qc * cum.exp()[..., None]  # reads the chunk's start state
    k_end = kc * (cum[..., -1:] - cum).exp()[..., None]  # writes the chunk's end state
    out = torch.empty_like(vc)
    for c in range(qc.shape[1]):
        u = u_v[:, c] - u_k[:, c] @ state  # (Hv, Q, Dv)
        out[:, c] = q_start[:, c] @ state + attn[:, c] @ u
        state = state * cum[:, c, -1].exp()[:, None, None] + k_end[:, c].transpose(-1, -2) @ u
    out = out.reshape(out.shape[0], -1, out.shape[-1])[:, :length]  # (Hv, L, Dv)
    return out.transpose(0, 1), state


def gated_delta_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    beta_scale: float,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The chunked gated delta rule over packed sequences, each from its slot's state (or zeros).

    Args:
        q, k: `(T, Hk, Dk)`; v: `(T, Hv, Dv)`; a, b: `(T, Hv)`; A_log, dt_bias: `(Hv,)`.
        beta_scale: `beta = beta_scale * sigmoid(b)`.
        ssm_states: `(S, Hv, Dk, Dv)`, read where `has_initial_state`, then overwritten with each
            sequence's final state (padding rows are skipped).
        query_start_loc: `(B + 1,)`; state_indices: `(B,)`; has_initial_state: `(B,)` bool.
        chunk_size: tokens per chunk (any length is cut at the sequence's own end).

    Returns:
        `(T, Hv, Dv)` outputs in the dtype of `v` (zeros for padding rows' tokens).
    """
    num_v_heads = v.shape[1]
    g, beta = gdn_gates_ref(a, b, A_log, dt_bias, beta_scale)
    qf, kf = _heads_qk(q, k, num_v_heads)
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    starts = query_start_loc.tolist()
    for i, slot in enumerate(state_indices.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if slot == PAD_SLOT_ID or hi == lo:
            continue
        if bool(has_initial_state[i]):
            init = ssm_states[slot].float()
        else:
            init = torch.zeros(ssm_states.shape[1:], dtype=torch.float32, device=v.device)
        o, final = _chunk_rule(
            qf[lo:hi], kf[lo:hi], v[lo:hi].float(), g[lo:hi], beta[lo:hi], init, chunk_size
        )
        out[lo:hi] = o
        ssm_states[slot] = final.to(ssm_states.dtype)
    return out.to(v.dtype)


def gated_delta_update_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    beta_scale: float,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """Advances each row's slot state by one token, in place (the recurrent form).

    Args:
        q, k: `(B, Hk, Dk)`; v: `(B, Hv, Dv)`; a, b: `(B, Hv)`; A_log, dt_bias: `(Hv,)`.
        beta_scale: `beta = beta_scale * sigmoid(b)`.
        ssm_states: `(S, Hv, Dk, Dv)`, updated in place for non-padding rows.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.

    Returns:
        `(B, Hv, Dv)` outputs in the dtype of `v` (zeros for padding rows).
    """
    valid = state_indices != PAD_SLOT_ID  # (B,)
    slots = state_indices.long().clamp(min=0)
    g, beta = gdn_gates_ref(a, b, A_log, dt_bias, beta_scale)  # (B, Hv)
    qf, kf = _heads_qk(q, k, v.shape[1])  # (B, Hv, Dk)
    old = ssm_states[slots].float() * torch.exp(g)[..., None, None]  # (B, Hv, Dk, Dv)
    kv_mem = torch.einsum("bhkv,bhk->bhv", old, kf)  # (B, Hv, Dv)
    delta = (v.float() - kv_mem) * beta[..., None]  # (B, Hv, Dv)
    state = old + kf[..., None] * delta[..., None, :]  # (B, Hv, Dk, Dv)
    out = torch.einsum("bhkv,bhk->bhv", state, qf) * valid[:, None, None]
    if bool(valid.any()):
        ssm_states[slots[valid]] = state[valid].to(ssm_states.dtype)
    return out.to(v.dtype)


def rms_norm_gated_ref(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`weight * rmsnorm(x) * silu(z)` over the last dimension (norm before the gate).

    Args:
        x, z: `(..., Dv)`; weight: `(Dv,)`; eps: the norm's epsilon.

    Returns:
        `(..., Dv)` in x's dtype; the statistics and the gate in float32, the normalised x cast
        to x's dtype before the weight (as transformers' `RMSNormGated`).
    """
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed) * F.silu(z.float())).to(x.dtype)


class VarlenOp(Protocol):
    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
        beta_scale: float, ssm_states: Tensor, query_start_loc: Tensor, state_indices: Tensor,
        has_initial_state: Tensor, chunk_size: int = 64,
    ) -> Tensor: ...  # fmt: skip


class UpdateOp(Protocol):
    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
        beta_scale: float, ssm_states: Tensor, state_indices: Tensor,
    ) -> Tensor: ...  # fmt: skip


class NormGateOp(Protocol):
    def __call__(self, x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor: ...


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    FAMILY,
    {
        "varlen": OpSpec(VarlenOp, gated_delta_varlen_ref),
        "update": OpSpec(UpdateOp, gated_delta_update_ref),
        "norm_gate": OpSpec(NormGateOp, rms_norm_gated_ref),
    },
)
