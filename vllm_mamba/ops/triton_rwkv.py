"""Triton kernels of the RWKV wkv op families, registered as the `triton` backend's versions by
`vllm_mamba.ops.triton_ops.register`: `rwkv7` (the generalised delta rule,
`varlen` and `update`) and `rwkv4` (the max-stabilised WKV, `varlen` and `update`).

Same signatures and semantics as `wkv7_varlen_ref` / `wkv7_update_ref` in `vllm_mamba.ops.rwkv7`
and `wkv4_varlen_ref` / `wkv4_update_ref` in `vllm_mamba.ops.rwkv4` (read their docstrings for
the math). Math is float32, inputs may be float32, bfloat16 or float16; outputs are rounded once.
Both kernels run the recurrence token by token with the state in float32 registers. No launcher
reads device data on the host, so each can be captured in a CUDA graph.

RWKV-7: one program owns one sequence (or decode row), one head and `BLOCK_V` value rows of
its `(Dv, Dk)` state: each value row evolves on its own (`s_i = s_i exp(w) + (s_i . a) b +
v_i k`, `o_i = s_i . r`), so the rows split across programs without communication. The state is
read from the slot (float32 or bfloat16) and stored once, after the sequence's last token.

RWKV-4: one program owns one sequence (or decode row) and `BLOCK_C` channels; the three float32
state vectors `(num, den, max)` stay in registers.

Glossary (token-major layout, as the references):
    T: tokens; B: sequences (or decode rows); S: state slots; H: heads; Dk, Dv: key / value head
    sizes (need not be powers of two: blocks are masked); C: RWKV-4 channels.
    RWKV-7: r, w, k, a, b `(T, H, Dk)`, v `(T, H, Dv)`, states `(S, H, Dv, Dk)`.
    RWKV-4: w, u `(C,)`, k, v `(T, C)`, num / den / max states `(S, C)` float32.
    Rows whose slot is `PAD_SLOT_ID` never touch a state: they run from a fresh state (zeros;
    RWKV-4 `(0, 0, MAX_INIT)`) and write only their outputs. A valid sequence writes its slot
    even when it has no token (its initial state, or a fresh one), as the references do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops import rwkv4

__all__ = ["wkv7_varlen", "wkv7_update", "wkv4_varlen", "wkv4_update"]

_MAX_BLOCK_V = 16  # RWKV-7 value rows per program (more programs for few sequences)
_MAX_BLOCK_C = 128  # RWKV-4 channels per program


@triton.jit
def _wkv7_kernel(
    r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, states_ptr, qsl_ptr, idx_ptr, init_ptr, out_ptr,
    key_dim, value_dim,
    stride_r_t, stride_r_h, stride_r_d, stride_w_t, stride_w_h, stride_w_d,
    stride_k_t, stride_k_h, stride_k_d, stride_v_t, stride_v_h, stride_v_d,
    stride_a_t, stride_a_h, stride_a_d, stride_b_t, stride_b_h, stride_b_d,
    stride_s_s, stride_s_h, stride_s_v, stride_s_k, stride_o_t, stride_o_h, stride_o_v,
    PAD_SLOT: tl.constexpr, IS_UPDATE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Runs the rule over the tokens of one sequence (or the one token of a decode row), one
    head and `BLOCK_V` value rows."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    valid = slot != PAD_SLOT
    if IS_UPDATE:
        start = seq.to(tl.int64)
        end = start + 1
        use_init = valid
    else:
        start = tl.load(qsl_ptr + seq).to(tl.int64)
        end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
        use_init = valid & (tl.load(init_ptr + seq) != 0)

    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    mask_k = offs_k < key_dim
    mask_v = offs_v < value_dim
    # (BLOCK_V, BLOCK_K) rows of the slot's state (slot 0 for padding, never read or written)
    state_ptrs = (
        states_ptr + tl.where(valid, slot, 0) * stride_s_s + head * stride_s_h
        + offs_v[:, None] * stride_s_v + offs_k[None, :] * stride_s_k
    )  # fmt: skip
    # Scalar conditions folded into row masks (the interpreter mistypes tensor & scalar).
    mask_init = tl.where(use_init, mask_v, False)[:, None] & mask_k[None, :]
    S = tl.load(state_ptrs, mask=mask_init, other=0.0).to(tl.float32)  # (BLOCK_V, BLOCK_K)

    # Masked key lanes read w = 0 (decay 1) and a = b = k = r = 0: they stay zero and add
    # nothing; masked value rows read v = 0 and stay zero.
    r_cols = r_ptr + head * stride_r_h + offs_k * stride_r_d  # (BLOCK_K,)
    w_cols = w_ptr + head * stride_w_h + offs_k * stride_w_d
    k_cols = k_ptr + head * stride_k_h + offs_k * stride_k_d
    a_cols = a_ptr + head * stride_a_h + offs_k * stride_a_d
    b_cols = b_ptr + head * stride_b_h + offs_k * stride_b_d
    v_rows = v_ptr + head * stride_v_h + offs_v * stride_v_d  # (BLOCK_V,)
    out_rows = out_ptr + head * stride_o_h + offs_v * stride_o_v
    for t in range(start, end):
        r = tl.load(r_cols + t * stride_r_t, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(w_cols + t * stride_w_t, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_cols + t * stride_k_t, mask=mask_k, other=0.0).to(tl.float32)
        a = tl.load(a_cols + t * stride_a_t, mask=mask_k, other=0.0).to(tl.float32)
        b = tl.load(b_cols + t * stride_b_t, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(v_rows + t * stride_v_t, mask=mask_v, other=0.0).to(tl.float32)
        sa = tl.sum(S * a[None, :], axis=1)  # (BLOCK_V,) S a, before this token's decay
        S = S * tl.exp(w)[None, :] + sa[:, None] * b[None, :] + v[:, None] * k[None, :]
        o = tl.sum(S * r[None, :], axis=1)  # (BLOCK_V,)
        tl.store(out_rows + t * stride_o_t, o.to(out_ptr.dtype.element_ty), mask=mask_v)

    mask_store = tl.where(valid, mask_v, False)[:, None] & mask_k[None, :]
    tl.store(state_ptrs, S.to(states_ptr.dtype.element_ty), mask=mask_store)


@triton.jit
def _wkv4_kernel(
    w_ptr, u_ptr, k_ptr, v_ptr, num_ptr, den_ptr, max_ptr, qsl_ptr, idx_ptr, init_ptr, out_ptr,
    channels,
    stride_w, stride_u, stride_k_t, stride_k_c, stride_v_t, stride_v_c,
    stride_num_s, stride_num_c, stride_den_s, stride_den_c, stride_max_s, stride_max_c,
    stride_o_t, stride_o_c,
    PAD_SLOT: tl.constexpr, MAX_INIT: tl.constexpr, IS_UPDATE: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Runs the WKV over the tokens of one sequence (or the one token of a decode row) for
    `BLOCK_C` channels."""
    seq = tl.program_id(0)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    valid = slot != PAD_SLOT
    if IS_UPDATE:
        start = seq.to(tl.int64)
        end = start + 1
        use_init = valid
    else:
        start = tl.load(qsl_ptr + seq).to(tl.int64)
        end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
        use_init = valid & (tl.load(init_ptr + seq) != 0)

    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    mask_c = offs_c < channels
    row = tl.where(valid, slot, 0)
    num_ptrs = num_ptr + row * stride_num_s + offs_c * stride_num_c  # (BLOCK_C,)
    den_ptrs = den_ptr + row * stride_den_s + offs_c * stride_den_c
    max_ptrs = max_ptr + row * stride_max_s + offs_c * stride_max_c
    # Scalar condition folded into the channel mask (the interpreter mistypes tensor & scalar).
    mask_init = tl.where(use_init, mask_c, False)
    num = tl.load(num_ptrs, mask=mask_init, other=0.0).to(tl.float32)  # (BLOCK_C,)
    den = tl.load(den_ptrs, mask=mask_init, other=0.0).to(tl.float32)
    mx = tl.load(max_ptrs, mask=mask_init, other=MAX_INIT).to(tl.float32)
    w = tl.load(w_ptr + offs_c * stride_w, mask=mask_c, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs_c * stride_u, mask=mask_c, other=0.0).to(tl.float32)

    k_cols = k_ptr + offs_c * stride_k_c  # (BLOCK_C,)
    v_cols = v_ptr + offs_c * stride_v_c
    out_cols = out_ptr + offs_c * stride_o_c
    for t in range(start, end):
        k = tl.load(k_cols + t * stride_k_t, mask=mask_c, other=0.0).to(tl.float32)
        v = tl.load(v_cols + t * stride_v_t, mask=mask_c, other=0.0).to(tl.float32)
        uk = u + k
        q = tl.maximum(mx, uk)  # the output, with this token's bonus
        e1 = tl.exp(mx - q)
        e2 = tl.exp(uk - q)
        wkv = (e1 * num + e2 * v) / (e1 * den + e2)
        tl.store(out_cols + t * stride_o_t, wkv.to(out_ptr.dtype.element_ty), mask=mask_c)
        decayed = mx + w
        p = tl.maximum(decayed, k)  # the state, decayed, then this token
        e1 = tl.exp(decayed - p)
        e2 = tl.exp(k - p)
        num = e1 * num + e2 * v
        den = e1 * den + e2
        mx = p

    mask_store = tl.where(valid, mask_c, False)
    tl.store(num_ptrs, num.to(num_ptr.dtype.element_ty), mask=mask_store)
    tl.store(den_ptrs, den.to(den_ptr.dtype.element_ty), mask=mask_store)
    tl.store(max_ptrs, mx.to(max_ptr.dtype.element_ty), mask=mask_store)


def _launch_wkv7(
    r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
    b: torch.Tensor, states: torch.Tensor, query_start_loc: torch.Tensor | None,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor | None, out: torch.Tensor,
) -> None:  # fmt: skip
    """Launches `_wkv7_kernel` over `(B, H, Dv / BLOCK_V)`; without `query_start_loc` row b is
    the one token b (the update)."""
    num_heads, key_dim = r.shape[1:]
    value_dim = v.shape[2]
    block_v = min(_MAX_BLOCK_V, triton.next_power_of_2(value_dim))
    grid = (state_indices.shape[0], num_heads, triton.cdiv(value_dim, block_v))
    is_update = query_start_loc is None
    _wkv7_kernel[grid](
        r, w, k, v, a, b, states,
        state_indices if is_update else query_start_loc, state_indices,
        state_indices if is_update else has_initial_state, out,
        key_dim, value_dim,
        *r.stride(), *w.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(),
        *states.stride(), *out.stride(),
        PAD_SLOT=PAD_SLOT_ID, IS_UPDATE=is_update,
        BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_v,
    )  # fmt: skip


def wkv7_varlen(
    r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
    b: torch.Tensor, states: torch.Tensor, query_start_loc: torch.Tensor,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `wkv7_varlen_ref` (see there for the arguments).

    Returns:
        `(T, H, Dv)` in r's dtype; `states` is updated in place.
    """
    out = torch.zeros(v.shape, dtype=r.dtype, device=v.device)  # (T, H, Dv)
    if state_indices.shape[0] == 0:
        return out
    _launch_wkv7(
        r, w, k, v, a, b, states, query_start_loc, state_indices, has_initial_state, out
    )  # fmt: skip
    return out


def wkv7_update(
    r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
    b: torch.Tensor, states: torch.Tensor, state_indices: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `wkv7_update_ref` (see there for the arguments).

    Returns:
        `(B, H, Dv)` in r's dtype (padding rows: the output of a zero state); `states` is
        updated in place.
    """
    out = torch.empty(v.shape, dtype=r.dtype, device=v.device)  # (B, H, Dv)
    if state_indices.shape[0] == 0:
        return out
    _launch_wkv7(r, w, k, v, a, b, states, None, state_indices, None, out)
    return out


def _launch_wkv4(
    w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_states: torch.Tensor,
    den_states: torch.Tensor, max_states: torch.Tensor, query_start_loc: torch.Tensor | None,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor | None, out: torch.Tensor,
) -> None:  # fmt: skip
    """Launches `_wkv4_kernel` over `(B, C / BLOCK_C)`; without `query_start_loc` row b is the
    one token b (the update)."""
    channels = k.shape[1]
    block_c = min(_MAX_BLOCK_C, triton.next_power_of_2(channels))
    grid = (state_indices.shape[0], triton.cdiv(channels, block_c))
    is_update = query_start_loc is None
    _wkv4_kernel[grid](
        w, u, k, v, num_states, den_states, max_states,
        state_indices if is_update else query_start_loc, state_indices,
        state_indices if is_update else has_initial_state, out,
        channels,
        w.stride(0), u.stride(0), *k.stride(), *v.stride(),
        *num_states.stride(), *den_states.stride(), *max_states.stride(), *out.stride(),
        PAD_SLOT=PAD_SLOT_ID, MAX_INIT=rwkv4.MAX_INIT, IS_UPDATE=is_update, BLOCK_C=block_c,
    )  # fmt: skip


def wkv4_varlen(
    w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_states: torch.Tensor,
    den_states: torch.Tensor, max_states: torch.Tensor, query_start_loc: torch.Tensor,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `wkv4_varlen_ref` (see there for the arguments).

    Returns:
        `(T, C)` in v's dtype; the three states are updated in place.
    """
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)  # (T, C)
    if state_indices.shape[0] == 0:
        return out
    _launch_wkv4(
        w, u, k, v, num_states, den_states, max_states,
        query_start_loc, state_indices, has_initial_state, out,
    )  # fmt: skip
    return out


def wkv4_update(
    w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_states: torch.Tensor,
    den_states: torch.Tensor, max_states: torch.Tensor, state_indices: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `wkv4_update_ref` (see there for the arguments).

    Returns:
        `(B, C)` in v's dtype (padding rows: the output of a fresh state); the three states
        are updated in place.
    """
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # (B, C)
    if state_indices.shape[0] == 0:
        return out
    _launch_wkv4(
        w, u, k, v, num_states, den_states, max_states, None, state_indices, None, out
    )  # fmt: skip
    return out
