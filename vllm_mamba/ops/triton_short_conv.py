"""Triton kernels of the `short_conv` op family (LFM2's gated short conv), registered as the
`triton` backend's versions by `vllm_mamba.ops.triton_ops.register`.

Same signatures and semantics as `short_conv_update_ref` / `short_conv_varlen_ref` in
`vllm_mamba.ops.short_conv`: from the in_proj output `bcx = [B | C | x]`, `C * conv(B * x)`
with float32 math, the history `conv_states (S, D, K - 1)` of `u = B * x` stored in the state's
dtype. Neither `u` nor the conv output is materialised: each tap loads `B` and `x` and multiplies.

Glossary:
    T: tokens; B: sequences (or decode rows); D: channels; K: conv width; S: state slots.
    bcx: `(T, 3D)` or `(B, 3D)`, any strides; weight: `(D, K)`. Rows whose slot is `PAD_SLOT_ID`
    never touch `conv_states` (their outputs use a zero history). One program handles one
    sequence (or decode row) and `BLOCK_D` channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mamba.cache_specs import PAD_SLOT_ID

__all__ = ["short_conv_update", "short_conv_varlen"]

_BLOCK_T = 16
_MAX_BLOCK_D = 64


@triton.jit
def _short_conv_varlen_kernel(
    bcx_ptr, w_ptr, bias_ptr, states_ptr, qsl_ptr, idx_ptr, init_ptr, out_ptr,
    dim,
    stride_i_t, stride_i_d, stride_w_d, stride_w_k,
    stride_s_s, stride_s_d, stride_s_k, stride_o_t, stride_o_d,
    PAD_SLOT: tl.constexpr, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    valid = slot != PAD_SLOT
    use_init = valid & (tl.load(init_ptr + seq) != 0)
    state_base = states_ptr + tl.where(valid, slot, 0) * stride_s_s

    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    mask_d = offs_d < dim
    # Scalar conditions folded into channel masks (the interpreter mistypes tensor & scalar).
    mask_d_init = tl.where(use_init, mask_d, False)  # (BLOCK_D,) channels read from history
    mask_d_slot = tl.where(valid, mask_d, False)  # (BLOCK_D,) channels written to the slot
    b_cols = offs_d * stride_i_d  # (BLOCK_D,) column offsets of B; C is D later, x 2D later
    c_cols = (offs_d + dim) * stride_i_d
    x_cols = (offs_d + 2 * dim) * stride_i_d
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)

    for t0 in range(start, end, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
        mask_td = (offs_t < end)[:, None] & mask_d[None, :]  # (BLOCK_T, BLOCK_D)
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32) + bias[None, :]
        for k in tl.static_range(WIDTH):
            # Input k of the window of token t is u at t - (K - 1) + k; before the sequence
            # start it is column (src - start + K - 1) of the saved history.
            src = offs_t - (WIDTH - 1) + k  # (BLOCK_T,)
            from_x = (src >= start)[:, None]
            rows = bcx_ptr + src[:, None] * stride_i_t  # (BLOCK_T, 1)
            bv = tl.load(rows + b_cols[None, :], mask=mask_td & from_x, other=0.0)
            xv = tl.load(rows + x_cols[None, :], mask=mask_td & from_x, other=0.0)
            hist_col = src - start + (WIDTH - 1)
            mask_hist = (offs_t < end)[:, None] & (~from_x) & mask_d_init[None, :]
            hv = tl.load(
                state_base + offs_d[None, :] * stride_s_d + hist_col[:, None] * stride_s_k,
                mask=mask_hist, other=0.0,
            )  # fmt: skip
            w = tl.load(w_ptr + offs_d * stride_w_d + k * stride_w_k, mask=mask_d, other=0.0)
            u = bv.to(tl.float32) * xv.to(tl.float32) + hv.to(tl.float32)  # (BLOCK_T, BLOCK_D)
            acc += u * w.to(tl.float32)[None, :]
        cv = tl.load(
            bcx_ptr + offs_t[:, None] * stride_i_t + c_cols[None, :], mask=mask_td, other=0.0
        )
        out = cv.to(tl.float32) * acc
        out_ptrs = out_ptr + offs_t[:, None] * stride_o_t + offs_d[None, :] * stride_o_d
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_td)

    # New history column j is u at end - (K - 1) + j (from bcx, or the old history if short).
    offs_h = tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    in_hist = (offs_h < WIDTH - 1)[None, :]
    mask_dh = mask_d[:, None] & in_hist  # (BLOCK_D, BLOCK_H)
    src = end - (WIDTH - 1) + offs_h
    from_x = (src >= start)[None, :]
    rows = bcx_ptr + src[None, :] * stride_i_t  # (1, BLOCK_H)
    bv = tl.load(rows + b_cols[:, None], mask=mask_dh & from_x, other=0.0)
    xv = tl.load(rows + x_cols[:, None], mask=mask_dh & from_x, other=0.0)
    hist_col = src - start + (WIDTH - 1)
    hv = tl.load(
        state_base + offs_d[:, None] * stride_s_d + hist_col[None, :] * stride_s_k,
        mask=mask_d_init[:, None] & in_hist & (~from_x), other=0.0,
    )  # fmt: skip
    new_hist = bv.to(tl.float32) * xv.to(tl.float32) + hv.to(tl.float32)  # (BLOCK_D, BLOCK_H)
    tl.debug_barrier()  # every read of the old history precedes the overwrite
    tl.store(
        state_base + offs_d[:, None] * stride_s_d + offs_h[None, :] * stride_s_k,
        new_hist.to(states_ptr.dtype.element_ty), mask=mask_d_slot[:, None] & in_hist,
    )  # fmt: skip


@triton.jit
def _short_conv_update_kernel(
    bcx_ptr, w_ptr, bias_ptr, states_ptr, idx_ptr, out_ptr,
    dim,
    stride_i_b, stride_i_d, stride_w_d, stride_w_k,
    stride_s_s, stride_s_d, stride_s_k, stride_o_b, stride_o_d,
    PAD_SLOT: tl.constexpr, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    valid = slot != PAD_SLOT
    state_base = states_ptr + tl.where(valid, slot, 0) * stride_s_s

    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    mask_d = offs_d < dim
    mask_d_slot = tl.where(valid, mask_d, False)  # (BLOCK_D,) channels of a real slot
    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    bcx_row = bcx_ptr + row * stride_i_b
    state_rows = state_base + offs_d[:, None] * stride_s_d  # (BLOCK_D, 1)

    bv = tl.load(bcx_row + offs_d * stride_i_d, mask=mask_d, other=0.0).to(tl.float32)
    cv = tl.load(bcx_row + (offs_d + dim) * stride_i_d, mask=mask_d, other=0.0).to(tl.float32)
    xv = tl.load(bcx_row + (offs_d + 2 * dim) * stride_i_d, mask=mask_d, other=0.0)
    u = bv * xv.to(tl.float32)  # (BLOCK_D,)
    # Window column k < K - 1 is history column k; column K - 1 is the new u.
    mask_hist = mask_d_slot[:, None] & (offs_k < WIDTH - 1)[None, :]  # (BLOCK_D, BLOCK_K)
    hist = tl.load(state_rows + offs_k[None, :] * stride_s_k, mask=mask_hist, other=0.0)
    is_new = (offs_k == WIDTH - 1)[None, :]
    window = tl.where(is_new, u[:, None], hist.to(tl.float32))  # (BLOCK_D, BLOCK_K)
    mask_w = mask_d[:, None] & (offs_k < WIDTH)[None, :]
    w = tl.load(
        w_ptr + offs_d[:, None] * stride_w_d + offs_k[None, :] * stride_w_k,
        mask=mask_w, other=0.0,
    )  # fmt: skip
    acc = tl.sum(window * w.to(tl.float32), axis=1)  # (BLOCK_D,)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    out = cv * acc
    tl.store(out_ptr + row * stride_o_b + offs_d * stride_o_d, out.to(out_ptr.dtype.element_ty),
             mask=mask_d)  # fmt: skip

    # New history column j is window column j + 1.
    mask_shift = mask_d_slot[:, None] & (offs_k < WIDTH - 2)[None, :]
    shifted = tl.load(state_rows + (offs_k[None, :] + 1) * stride_s_k, mask=mask_shift, other=0.0)
    new_hist = tl.where((offs_k == WIDTH - 2)[None, :], u[:, None], shifted.to(tl.float32))
    tl.debug_barrier()  # every read of the old history precedes the overwrite
    mask_store = mask_d_slot[:, None] & (offs_k < WIDTH - 1)[None, :]
    tl.store(state_rows + offs_k[None, :] * stride_s_k,
             new_hist.to(states_ptr.dtype.element_ty), mask=mask_store)  # fmt: skip


def _block_d(dim: int) -> int:
    return min(_MAX_BLOCK_D, triton.next_power_of_2(dim))


def short_conv_varlen(
    bcx: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `short_conv_varlen_ref` (see there for the arguments); K >= 2.

    Returns:
        `(T, D)` `C * conv(B * x)` in bcx's dtype; `conv_states` is updated in place.
    """
    num_tokens, dim = bcx.shape[0], bcx.shape[1] // 3
    width = weight.shape[1]
    batch = state_indices.shape[0]
    out = bcx.new_empty(num_tokens, dim)  # (T, D)
    if batch == 0:  # (empty sequences still write their slots)
        return out
    block_d = _block_d(dim)
    grid = (batch, triton.cdiv(dim, block_d))
    _short_conv_varlen_kernel[grid](
        bcx, weight, bias if bias is not None else weight, conv_states,
        query_start_loc, state_indices, has_initial_state, out,
        dim,
        bcx.stride(0), bcx.stride(1), weight.stride(0), weight.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        out.stride(0), out.stride(1),
        PAD_SLOT=PAD_SLOT_ID, WIDTH=width, HAS_BIAS=bias is not None,
        BLOCK_T=_BLOCK_T, BLOCK_D=block_d, BLOCK_H=triton.next_power_of_2(width - 1),
    )  # fmt: skip
    return out


def short_conv_update(
    bcx: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    state_indices: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `short_conv_update_ref`; K >= 2, no host syncs (CUDA-graph capturable).

    Returns:
        `(B, D)` `C * conv(B * x)` in bcx's dtype; padding rows get the output of a zero
        history.
    """
    batch, dim = bcx.shape[0], bcx.shape[1] // 3
    width = weight.shape[1]
    out = bcx.new_empty(batch, dim)  # (B, D)
    if batch == 0:
        return out
    block_d = _block_d(dim)
    grid = (batch, triton.cdiv(dim, block_d))
    _short_conv_update_kernel[grid](
        bcx, weight, bias if bias is not None else weight, conv_states, state_indices, out,
        dim,
        bcx.stride(0), bcx.stride(1), weight.stride(0), weight.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        out.stride(0), out.stride(1),
        PAD_SLOT=PAD_SLOT_ID, WIDTH=width, HAS_BIAS=bias is not None,
        BLOCK_D=block_d, BLOCK_K=triton.next_power_of_2(width),
    )  # fmt: skip
    return out
