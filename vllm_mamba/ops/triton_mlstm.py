"""Triton kernels of the `mlstm` op family (xLSTM's matrix-memory cell), registered as the
`triton` backend's versions by `vllm_mamba.ops.triton_ops.register`.

Same signatures and semantics as `mlstm_varlen_ref` / `mlstm_update_ref` in
`vllm_mamba.ops.mlstm` (read its docstring for the equations): exponential gates with the
stabiliser `m`, the matrix memory `C (Dk, Dv)` and normaliser `n (Dk,)` per head, the output
`(s q) C / (max(|(s q) . n|, exp(-m)) + eps)`, a fresh sequence from zeros (`m` too); float32
math, states stored in their own dtypes, outputs in q's dtype. One program serves one
sequence (or decode row) and one head: for each block of `BLOCK_V` value columns it walks the
tokens holding that `(Dk, BLOCK_V)` tile of `C`, the whole `n` and `m` (recomputed alike per
block, stored once after the last block, so that no block reads a state another has written).
The prefill is the recurrence itself, not the chunkwise form of the references: the same sums
in another order.

Glossary:
    T: tokens; B: sequences (or decode rows); S: state slots; H: heads; Dk, Dv: key and value
    head dims. q, k: `(T, H, Dk)`; v: `(T, H, Dv)`; igate, fgate: `(T, H)`; c_states:
    `(S, H, Dk, Dv)`; n_states: `(S, H, Dk)`; m_states: `(S, H)`, all contiguous. Rows whose
    slot is `PAD_SLOT_ID` never touch the states and output zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.mlstm import CHUNK_SIZE, EPS
from vllm_mamba.ops.triton_ssd import _softplus

__all__ = ["mlstm_update", "mlstm_varlen"]

_MAX_BLOCK_V = 32  # value columns per program: the state tile is (Dk, BLOCK_V) float32


@triton.jit
def _mlstm_columns(
    q_ptr, k_ptr, v_ptr, i_ptr, f_ptr, c_ptr, n_ptr, m_ptr, out_ptr, heads, dk, dv, scale, eps,
    start, end, head, base, read, live, offs_v, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The sequence's tokens for the value columns `offs_v`: its `C` tile advanced and stored;
    returns `n (BLOCK_K,)` and `m` after its last token (the same for every column block)."""
    offs_k = tl.arange(0, BLOCK_K)
    mask_k, mask_v = offs_k < dk, offs_v < dv
    c_tile = c_ptr + base * dk * dv + offs_k[:, None] * dv + offs_v[None, :]
    tile_mask = mask_k[:, None] & mask_v[None, :]
    c = tl.load(c_tile, mask=tl.where(read, tile_mask, False), other=0.0).to(tl.float32)
    n = tl.load(n_ptr + base * dk + offs_k, mask=tl.where(read, mask_k, False), other=0.0)
    m = tl.load(m_ptr + base, mask=read, other=0.0).to(tl.float32)
    n = n.to(tl.float32)
    for t in range(start, end):
        row = t * heads + head
        q = tl.load(q_ptr + row * dk + offs_k, mask=mask_k, other=0.0).to(tl.float32) * scale
        k = tl.load(k_ptr + row * dk + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * dv + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        i = tl.load(i_ptr + row).to(tl.float32)
        lf = -_softplus(-tl.load(f_ptr + row).to(tl.float32))  # log sigmoid(f)
        m_new = tl.maximum(lf + m, i)
        decay, gain = tl.exp(lf + m - m_new), tl.exp(i - m_new)
        c = decay * c + gain * (k[:, None] * v[None, :])  # (BLOCK_K, BLOCK_V)
        n = decay * n + gain * k
        m = m_new
        num = tl.sum(q[:, None] * c, axis=0)  # (BLOCK_V,)
        den = tl.maximum(tl.abs(tl.sum(q * n, axis=0)), tl.exp(-m)) + eps
        out = out_ptr + row * dv + offs_v
        tl.store(out, (num / den).to(out_ptr.dtype.element_ty), mask=mask_v)
    tl.store(c_tile, c.to(c_ptr.dtype.element_ty), mask=tl.where(live, tile_mask, False))
    return n, m


@triton.jit
def _mlstm_kernel(
    q_ptr, k_ptr, v_ptr, i_ptr, f_ptr, c_ptr, n_ptr, m_ptr, qsl_ptr, idx_ptr, init_ptr,
    out_ptr, heads, dk, dv, scale, eps,
    PAD_SLOT: tl.constexpr, VARLEN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    seq, head = tl.program_id(0), tl.program_id(1)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    live = slot != PAD_SLOT
    if VARLEN:
        start = tl.load(qsl_ptr + seq)
        end = tl.load(qsl_ptr + seq + 1)
        read = live & (tl.load(init_ptr + seq) != 0)  # a fresh sequence starts from zeros
    else:
        start = seq
        end = seq + 1
        read = live
    end = tl.where(live, end, start)  # a padding row runs no token
    base = tl.where(live, slot, 0) * heads + head  # (slot, head) row of the states
    offs_k = tl.arange(0, BLOCK_K)
    n_row = n_ptr + base * dk + offs_k
    n = tl.load(n_row, mask=tl.where(read, offs_k < dk, False), other=0.0).to(tl.float32)
    m = tl.load(m_ptr + base, mask=read, other=0.0).to(tl.float32)
    # `n` and `m` are stored after the last column block: every block reads them first
    for first_v in range(0, dv, BLOCK_V):
        n, m = _mlstm_columns(
            q_ptr, k_ptr, v_ptr, i_ptr, f_ptr, c_ptr, n_ptr, m_ptr, out_ptr, heads, dk, dv,
            scale, eps, start, end, head, base, read, live, first_v + tl.arange(0, BLOCK_V),
            BLOCK_K,
        )  # fmt: skip
    tl.store(n_row, n.to(n_ptr.dtype.element_ty), mask=tl.where(live, offs_k < dk, False))
    tl.store(m_ptr + base, m.to(m_ptr.dtype.element_ty), mask=live)


def _launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor, fgate: torch.Tensor,
    states: tuple[torch.Tensor, torch.Tensor, torch.Tensor], state_indices: torch.Tensor,
    eps: float, qsl: torch.Tensor | None = None, init: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Runs the kernel over `state_indices.numel()` sequences (varlen when `qsl` is given)."""
    q, k, v, igate, fgate = (t.contiguous() for t in (q, k, v, igate, fgate))
    assert all(s.is_contiguous() for s in states), "c, n, m states: contiguous"
    out = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    rows, heads, dk, dv = state_indices.numel(), q.shape[1], q.shape[2], v.shape[2]
    if rows == 0 or q.shape[0] == 0:
        return out
    block_v = min(triton.next_power_of_2(dv), _MAX_BLOCK_V)
    varlen = qsl is not None
    grid = (rows, heads)
    _mlstm_kernel[grid](
        q, k, v, igate, fgate, *states, qsl if varlen else state_indices, state_indices,
        init if varlen else state_indices, out, heads, dk, dv, dk**-0.5, eps,
        PAD_SLOT=PAD_SLOT_ID, VARLEN=varlen, BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=block_v,
    )  # fmt: skip
    return out


def mlstm_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor, fgate: torch.Tensor,
    c_states: torch.Tensor, n_states: torch.Tensor, m_states: torch.Tensor,
    query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    eps: float = EPS, chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:  # fmt: skip
    """The mLSTM over packed sequences; see `mlstm_varlen_ref` (`chunk_size` is unused: the
    kernel walks the recurrence)."""
    init = has_initial_state.to(torch.int32)
    states = (c_states, n_states, m_states)
    return _launch(q, k, v, igate, fgate, states, state_indices, eps, query_start_loc, init)


def mlstm_update(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor, fgate: torch.Tensor,
    c_states: torch.Tensor, n_states: torch.Tensor, m_states: torch.Tensor,
    state_indices: torch.Tensor, eps: float = EPS,
) -> torch.Tensor:  # fmt: skip
    """One token per row; see `mlstm_update_ref`."""
    return _launch(q, k, v, igate, fgate, (c_states, n_states, m_states), state_indices, eps)
