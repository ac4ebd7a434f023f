"""The lightning-attention ops: MiniMax-Text-01's linear attention with a fixed decay per head,
over a flat varlen batch, and its one-token update. Pure-PyTorch references (`*_ref`),
registered as the op family `lightning_attention` (`vllm_mamba.ops.families`).

Lightning attention (transformers' `MiniMaxLightningAttention`) keeps per sequence and head a
state `S (Dk, Dv)`; per token, with `q, k, v = silu(qkv_proj(x))` split per head and the head's
fixed slope `s > 0` (no gate, no normalisation of q or k, no softmax scale):

    S = exp(-s) S + k^T v ;  o = q S

(the layer then normalises `o` over all heads and gates it: `layers.lightning_attention`).
transformers computes a prompt in blocks of `block_size` tokens: inside a block
`o_i = (q_i exp(-s (i + 1))) S0 + sum_{j <= i} (q_i . k_j) exp(-s (i - j)) v_j` and the block's
end state is `exp(-s n) S0 + sum_j exp(-s (n - 1 - j)) k_j^T v_j` (n tokens, `S0` the state
at its start); every exponent is `<= 0`, so no factor overflows, and the form is exact for any
block length. The references run it in chunks of `chunk_size` tokens.

The state is stored transposed, `(H, Dv, Dk)`: it is Mamba2's SSD state `(H, P, N)` for the
same recurrence, `h = exp(dt A) h + dt x (outer) B, y = h @ C` with `dt = 1`, `A = -s`,
`x = v`, `B = k`, `C = q` and one group per head (`ssd_chunk_scan_varlen_ref`). A backend with
its own SSD kernels but no lightning kernels runs lightning attention on them
(`lightning_ops`): the same arithmetic, token by token in float32 (C++) or in exact chunks
(Triton).

Glossary (token-major layout):
    T: tokens; B: sequences (or decode rows); S: state slots; H: heads; Dk, Dv: key and value
    head dims (MiniMax: both `head_dim`); Q: chunk size.
    q, k: `(T, H, Dk)`; v: `(T, H, Dv)`; slope: `(H,)` float32, `> 0`.
    ssm_states: `(S, H, Dv, Dk)` per-slot state (float32 or bfloat16, math in float32).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import TYPE_CHECKING, Protocol

import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.families import OpFamily, OpSpec, has_own_op

if TYPE_CHECKING:
    from vllm_mamba.ops.table import MambaOps

Tensor = torch.Tensor

__all__ = [
    "CHUNK_SIZE",
    "FAMILY",
    "lightning_ops",
    "lightning_update_ref",
    "lightning_varlen_ref",
]

FAMILY = "lightning_attention"
CHUNK_SIZE = 64  # tokens per chunk of the reference's prefill (any length is exact)


def _chunked_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slope: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over one sequence in chunks (float32).

    Args:
        q, k: `(L, H, Dk)`; v: `(L, H, Dv)`; slope: `(H,)`; state: `(H, Dv, Dk)` before the
        first token; chunk_size: Q.

    Returns:
        `o (L, H, Dv)` and the state after the last token `(H, Dv, Dk)`.
    """
    out = torch.empty_like(v)
    rate = slope[:, None]  # (H, 1)
    for start in range(0, q.shape[0], chunk_size):
        qc, kc, vc = (t[start : start + chunk_size].transpose(0, 1) for t in (q, k, v))
        n = qc.shape[1]  # (H, n, D) each
        pos = torch.arange(n, device=q.device, dtype=torch.float32)  # (n,)
        gap = pos[:, None] - pos[None, :]  # (n, n): i - j
        causal = torch.exp(-rate[..., None] * gap.clamp(min=0)) * (gap >= 0)  # (H, n, n)
        scores = (qc @ kc.transpose(-1, -2)) * causal  # (H, n, n)
        from_start = qc * torch.exp(-rate * (pos + 1))[..., None]  # (H, n, Dk)
        o = scores @ vc + from_start @ state.transpose(-1, -2)  # (H, n, Dv)
        out[start : start + n] = o.transpose(0, 1)
        to_end = vc * torch.exp(-rate * (n - 1 - pos))[..., None]  # (H, n, Dv)
        state = torch.exp(-rate * n)[..., None] * state + to_end.transpose(-1, -2) @ kc
    return out, state


def lightning_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slope: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """Lightning attention over packed sequences, each from its slot's state (or zeros).

    Args:
        q, k: `(T, H, Dk)`; v: `(T, H, Dv)`; slope: `(H,)` the heads' decay rates.
        ssm_states: `(S, H, Dv, Dk)`, read where `has_initial_state`, then overwritten with each
            sequence's final state (padding rows are skipped; an empty fresh sequence leaves
            zeros).
        query_start_loc: `(B + 1,)` int32; state_indices: `(B,)` int32 slots, `PAD_SLOT_ID`
            rows skipped; has_initial_state: `(B,)` bool.
        chunk_size: tokens per chunk (the result is the same for every chunk size, up to
            rounding).

    Returns:
        `(T, H, Dv)` outputs in q's dtype (zeros for padding rows' tokens here; a backend may
        leave them unspecified).
    """
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    rate = slope.float()
    starts = query_start_loc.tolist()
    for i, slot in enumerate(state_indices.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if slot == PAD_SLOT_ID:
            continue
        if bool(has_initial_state[i]):
            init = ssm_states[slot].float()
        else:
            init = torch.zeros(ssm_states.shape[1:], dtype=torch.float32, device=v.device)
        o, final = _chunked_scan(
            q[lo:hi].float(), k[lo:hi].float(), v[lo:hi].float(), rate, init, chunk_size
        )
        out[lo:hi] = o
        ssm_states[slot] = final.to(ssm_states.dtype)
    return out.to(q.dtype)


def lightning_update_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slope: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """Advances each row's slot state by one token, in place.

    Args:
        q, k: `(B, H, Dk)`; v: `(B, H, Dv)`; slope: `(H,)`.
        ssm_states: `(S, H, Dv, Dk)`, updated in place for non-padding rows.
        state_indices: `(B,)` int32 slot per row, `PAD_SLOT_ID` rows are skipped.

    Returns:
        `(B, H, Dv)` outputs in q's dtype (zeros for padding rows here; a backend may leave
        them unspecified).
    """
    valid = state_indices != PAD_SLOT_ID  # (B,)
    slots = state_indices.long().clamp(min=0)
    decay = torch.exp(-slope.float())[None, :, None, None]  # (1, H, 1, 1)
    kv = v.float()[..., :, None] * k.float()[..., None, :]  # (B, H, Dv, Dk)
    state = decay * ssm_states[slots].float() + kv  # (B, H, Dv, Dk)
    out = torch.einsum("bhvk,bhk->bhv", state, q.float()) * valid[:, None, None]
    if bool(valid.any()):
        ssm_states[slots[valid]] = state[valid].to(ssm_states.dtype)
    return out.to(q.dtype)


def _varlen_via_ssd(
    ssd_varlen: object,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    slope: Tensor,
    ssm_states: Tensor,
    query_start_loc: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> Tensor:
    """`lightning_varlen_ref`'s op as an SSD scan (see the module docstring)."""
    return ssd_varlen(  # type: ignore[operator]
        x=v, dt=v.new_ones(v.shape[:2]), A=-slope.float(), B_=k, C=q, D_skip=None,
        dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")), ssm_states=ssm_states,
        query_start_loc=query_start_loc, state_indices=state_indices,
        has_initial_state=has_initial_state, chunk_size=chunk_size,
    )  # fmt: skip


def _update_via_ssd(
    ssd_update: object,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    slope: Tensor,
    ssm_states: Tensor,
    state_indices: Tensor,
) -> Tensor:
    """`lightning_update_ref`'s op as an SSD state update (see the module docstring)."""
    return ssd_update(  # type: ignore[operator]
        ssm_states=ssm_states, x=v, dt=v.new_ones(v.shape[:2]), A=-slope.float(), B_=k, C=q,
        D_skip=None, dt_bias=None, dt_softplus=False, state_indices=state_indices,
    )  # fmt: skip


def lightning_ops(ops: MambaOps) -> SimpleNamespace:
    """The lightning ops of `ops`' backend: its own where it registered them; else, where it
    has its own SSD kernels, those (the same recurrence, see the module docstring); else the
    references."""
    own = ops.family(FAMILY)
    if has_own_op(FAMILY, ops.name, "varlen") or not has_own_op("ssd", ops.name, "state_update"):
        return own
    return SimpleNamespace(
        varlen=functools.partial(_varlen_via_ssd, ops.ssd_chunk_scan_varlen),
        update=functools.partial(_update_via_ssd, ops.ssd_state_update),
    )


class VarlenOp(Protocol):
    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, slope: Tensor, ssm_states: Tensor,
        query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
        chunk_size: int = CHUNK_SIZE,
    ) -> Tensor: ...  # fmt: skip


class UpdateOp(Protocol):
    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, slope: Tensor, ssm_states: Tensor,
        state_indices: Tensor,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    FAMILY,
    {
        "varlen": OpSpec(VarlenOp, lightning_varlen_ref),
        "update": OpSpec(UpdateOp, lightning_update_ref),
    },
)
