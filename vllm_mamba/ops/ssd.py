"""Mamba2's state-space duality (SSD) scan over a flat varlen batch, and its decode update.

Pure-PyTorch references (`*_ref`); fast kernels would share these signatures and are chosen
in `vllm_mamba.ops.dispatch`.

Glossary (token-major layout):
    T: tokens; B: sequences; H: heads; P: head dim; G: groups of B/C (H is a multiple of G);
    N: state size; S: state slots; Q: SSD chunk size; L: longest sequence padded to Q;
    c: chunk index, l / s: positions inside a chunk (target / source).
    x: `(T, H, P)` input; dt: `(T, H)` time step before bias and softplus; A: `(H,)` scalar
    decay per head; B_, C: `(T, G, N)`; D_skip: `(H,)`.
    ssm_states: `(S, H, P, N)` per-slot state, updated in float32 math.
    Per token and head: h = exp(dt * A) * h + dt * x (outer) B, y = h @ C + D * x.
    The chunked form splits each sequence into chunks of Q tokens: inside a chunk the output is
    a masked "attention" `(C B^T * decay) @ (dt * x)`, and the states at chunk boundaries are
    carried by a short recurrence over the chunks.
"""

from __future__ import annotations

from typing import Protocol

import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.discretize import discretize_dt
from vllm_mamba.ops.families import OpFamily, OpSpec

Tensor = torch.Tensor


def _expand_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`(..., G, N)` -> `(..., H, N)`: head `h` reads group `h // (H / G)`."""
    groups = t.shape[-2]
    return t.repeat_interleave(num_heads // groups, dim=-2)


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """`a (..., Q)` -> `(..., Q, Q)` with `[l, s] = a[s+1] + .. + a[l]` for s <= l, else -inf.

    Summed directly (a cumulative sum down each column) rather than as a difference of
    cumulative sums, which loses precision.
    """
    q = a.shape[-1]
    cols = a[..., :, None].expand(*a.shape, q)  # [k, s] = a[k]
    after = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), diagonal=-1)
    seg = cols.masked_fill(~after, 0.0).cumsum(-2)  # [l, s] = sum over s < k <= l of a[k]
    causal = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), diagonal=0)
    return seg.masked_fill(~causal, float("-inf"))


def _chunk_scan(
    xdt: torch.Tensor,
    dA: torch.Tensor,
    B_: torch.Tensor,
    C: torch.Tensor,
    init: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD recurrence on padded, chunked sequences (float32).

    Args:
        xdt: `(B, c, Q, H, P)` inputs times their time steps.
        dA: `(B, c, Q, H)` log decays `dt * A`.
        B_, C: `(B, c, Q, H, N)` per-head projections.
        init: `(B, H, P, N)` state before the first chunk.

    Returns:
        `y (B, c, Q, H, P)` without the skip term, and the final state `(B, H, P, N)`.
    """
    num_chunks = xdt.shape[1]
    dA_h = dA.permute(0, 1, 3, 2)  # (B, c, H, Q)
    cum = dA_h.cumsum(-1)  # (B, c, H, Q)
    # Inside each chunk: y[l] = sum_{s <= l} (C[l] . B[s]) exp(cum[l] - cum[s]) xdt[s].
    decay = torch.exp(_segment_sum(dA_h))  # (B, c, H, l, s)
    scores = torch.einsum("bclhn,bcshn->bchls", C, B_) * decay  # (B, c, H, l, s)
    y = torch.einsum("bchls,bcshp->bclhp", scores, xdt)  # (B, c, Q, H, P)
    # Each chunk's own contribution to the state at its end.
    to_end = torch.exp(cum[..., -1:] - cum)  # (B, c, H, Q)
    chunk_states = torch.einsum("bclhn,bchl,bclhp->bchpn", B_, to_end, xdt)  # (B, c, H, P, N)
    # Carry the states across chunk boundaries.
    chunk_decay = torch.exp(cum[..., -1])  # (B, c, H)
    state = init
    starts = []
    for c in range(num_chunks):
        starts.append(state)
        state = state * chunk_decay[:, c, :, None, None] + chunk_states[:, c]
    start_states = torch.stack(starts, dim=1)  # (B, c, H, P, N)
    # The start state's contribution, decayed to each position.
    from_start = torch.exp(cum).permute(0, 1, 3, 2)  # (B, c, Q, H)
    y = y + torch.einsum("bclhn,bchpn->bclhp", C, start_states) * from_start[..., None]
    return y, state


def ssd_chunk_scan_varlen_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B_: torch.Tensor,
    C: torch.Tensor,
    D_skip: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    """Chunked SSD scan of packed sequences, each from its slot's state (or zeros).

    Each sequence is cut into chunks of `chunk_size` tokens from its own first token; the
    padding after its last token has a zero time step, so it leaves the state unchanged.

    Args:
        x: `(T, H, P)`; dt: `(T, H)`; A: `(H,)`; B_, C: `(T, G, N)`;
            D_skip, dt_bias: `(H,)` or None.
        dt_softplus: apply softplus to `dt + dt_bias`; the result is clamped to `dt_limit`.
        ssm_states: `(S, H, P, N)`, read where `has_initial_state`, then overwritten with each
            sequence's final state (padding rows are skipped).
        query_start_loc: `(B + 1,)`; state_indices: `(B,)`; has_initial_state: `(B,)` bool.
        chunk_size: tokens per SSD chunk.

    Returns:
        `(T, H, P)` outputs in the dtype of `x`.
    """
    num_tokens, num_heads, head_dim = x.shape
    batch = state_indices.shape[0]
    device = x.device
    qsl = query_start_loc.long()
    lens = qsl[1:] - qsl[:-1]  # (B,)
    max_len = int(lens.max()) if batch > 0 else 0
    padded = -(-max_len // chunk_size) * chunk_size
    num_chunks = padded // chunk_size
    valid = state_indices != PAD_SLOT_ID  # (B,)
    slots = state_indices.long().clamp(min=0)

    pos = torch.arange(padded, device=device)  # (L,)
    in_seq = pos[None, :] < lens[:, None]  # (B, L)
    tok = (qsl[:-1, None] + pos[None, :]).clamp(max=max(num_tokens - 1, 0))  # (B, L)

    delta = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)[tok] * in_seq[..., None]  # (B,L,H)
    xdt = x.float()[tok] * delta[..., None]  # (B, L, H, P)
    Bh = _expand_groups(B_.float()[tok], num_heads)  # (B, L, H, N)
    Ch = _expand_groups(C.float()[tok], num_heads)  # (B, L, H, N)
    dA = delta * A.float()  # (B, L, H)

    def chunks(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch, num_chunks, chunk_size, *t.shape[2:])

    init = ssm_states[slots].float() * (has_initial_state & valid)[:, None, None, None]
    y, final = _chunk_scan(chunks(xdt), chunks(dA), chunks(Bh), chunks(Ch), init)
    y = y.reshape(batch, padded, num_heads, head_dim)  # (B, L, H, P)

    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=device)
    out[tok[in_seq]] = y[in_seq]
    if D_skip is not None:
        out = out + x.float() * D_skip.float()[:, None]
    if bool(valid.any()):
        ssm_states[slots[valid]] = final[valid].to(ssm_states.dtype)
    return out.to(x.dtype)


def ssd_state_update_ref(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B_: torch.Tensor,
    C: torch.Tensor,
    D_skip: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """Advances each row's slot state by one token, per head, in place.

    Like `transformers` and `mamba-ssm`, the one-token step does not clamp dt to `dt_limit`.

    Args:
        ssm_states: `(S, H, P, N)`, updated in place for non-padding rows.
        x: `(B, H, P)`; dt: `(B, H)`; A: `(H,)`; B_, C: `(B, G, N)`;
            D_skip, dt_bias: `(H,)` or None.
        dt_softplus: apply softplus to `dt + dt_bias`.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.

    Returns:
        `(B, H, P)` outputs in the dtype of `x` (padding rows hold unspecified values).
    """
    num_heads = x.shape[1]
    valid = state_indices != PAD_SLOT_ID
    slots = state_indices.long().clamp(min=0)
    delta = discretize_dt(dt, dt_bias, dt_softplus)  # (B, H)
    dA = torch.exp(delta * A.float())  # (B, H)
    Bh = _expand_groups(B_.float(), num_heads)  # (B, H, N)
    Ch = _expand_groups(C.float(), num_heads)  # (B, H, N)
    xdt = x.float() * delta[..., None]  # (B, H, P)
    old = ssm_states[slots]  # (B, H, P, N)
    state = old.float() * dA[..., None, None] + xdt[..., None] * Bh[:, :, None, :]
    # Written without a host sync (CUDA graphs): each padding row repeats the write of the
    # first real row, or writes back the value it read when there is none.
    src = torch.where(valid, torch.arange(len(valid), device=x.device), valid.int().argmax())
    new = torch.where(valid[src, None, None, None], state[src].to(old.dtype), old[src])
    ssm_states[slots[src]] = new
    y = torch.einsum("bhpn,bhn->bhp", state, Ch)  # (B, H, P)
    if D_skip is not None:
        y = y + x.float() * D_skip.float()[:, None]
    return y.to(x.dtype)


class SSDVarlenOp(Protocol):
    def __call__(
        self, x: Tensor, dt: Tensor, A: Tensor, B_: Tensor, C: Tensor, D_skip: Tensor | None,
        dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float],
        ssm_states: Tensor, query_start_loc: Tensor, state_indices: Tensor,
        has_initial_state: Tensor, chunk_size: int,
    ) -> Tensor: ...  # fmt: skip


class SSDUpdateOp(Protocol):
    def __call__(
        self, ssm_states: Tensor, x: Tensor, dt: Tensor, A: Tensor, B_: Tensor, C: Tensor,
        D_skip: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool, state_indices: Tensor,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    "ssd",
    {
        "chunk_scan_varlen": OpSpec(SSDVarlenOp, ssd_chunk_scan_varlen_ref),
        "state_update": OpSpec(SSDUpdateOp, ssd_state_update_ref),
    },
)
