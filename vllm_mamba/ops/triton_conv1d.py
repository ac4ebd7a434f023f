"""Triton kernels for the causal depthwise conv1d: varlen prefill and one-token decode update.

Same signatures and semantics as `causal_conv1d_varlen_ref` / `causal_conv1d_update_ref` in
`vllm_mamba.ops.causal_conv1d`. Math is float32; inputs may be float32, bfloat16 or float16.

Glossary:
    T: tokens; B: sequences (or decode rows); D: channels; K: conv width; S: state slots.
    x: `(T, D)` or `(B, D)`; weight: `(D, K)`; conv_states: `(S, D, K - 1)` holding the last
    `K - 1` inputs of each slot. Rows whose slot is `PAD_SLOT_ID` never touch `conv_states`.
    One program handles one sequence (or decode row) and `BLOCK_D` channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mamba.cache_specs import PAD_SLOT_ID

_BLOCK_T = 16
_MAX_BLOCK_D = 64


@triton.jit
def _conv1d_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, states_ptr, qsl_ptr, idx_ptr, init_ptr, out_ptr,
    dim,
    stride_x_t, stride_x_d, stride_w_d, stride_w_k,
    stride_s_s, stride_s_d, stride_s_k, stride_o_t, stride_o_d,
    PAD_SLOT: tl.constexpr, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
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
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)

    for t0 in range(start, end, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
        mask_td = (offs_t < end)[:, None] & mask_d[None, :]  # (BLOCK_T, BLOCK_D)
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32) + bias[None, :]
        for k in tl.static_range(WIDTH):
            # Input k of the window of token t is token t - (K - 1) + k; before the sequence
            # start it is column (src - start + K - 1) of the saved history.
            src = offs_t - (WIDTH - 1) + k  # (BLOCK_T,)
            from_x = (src >= start)[:, None]
            xv = tl.load(
                x_ptr + src[:, None] * stride_x_t + offs_d[None, :] * stride_x_d,
                mask=mask_td & from_x, other=0.0,
            )  # fmt: skip
            hist_col = src - start + (WIDTH - 1)
            mask_hist = (offs_t < end)[:, None] & (~from_x) & mask_d_init[None, :]
            hv = tl.load(
                state_base + offs_d[None, :] * stride_s_d + hist_col[:, None] * stride_s_k,
                mask=mask_hist, other=0.0,
            )  # fmt: skip
            w = tl.load(w_ptr + offs_d * stride_w_d + k * stride_w_k, mask=mask_d, other=0.0)
            acc += (xv.to(tl.float32) + hv.to(tl.float32)) * w.to(tl.float32)[None, :]
        if ACTIVATION:
            acc = acc * tl.sigmoid(acc)
        out_ptrs = out_ptr + offs_t[:, None] * stride_o_t + offs_d[None, :] * stride_o_d
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_td)

    if WIDTH > 1:
        # New history column j is input end - (K - 1) + j (from x, or old history if short).
        offs_h = tl.arange(0, BLOCK_H)  # (BLOCK_H,)
        in_hist = (offs_h < WIDTH - 1)[None, :]
        mask_dh = mask_d[:, None] & in_hist  # (BLOCK_D, BLOCK_H)
        src = end - (WIDTH - 1) + offs_h
        from_x = (src >= start)[None, :]
        xv = tl.load(
            x_ptr + src[None, :] * stride_x_t + offs_d[:, None] * stride_x_d,
            mask=mask_dh & from_x, other=0.0,
        )  # fmt: skip
        hist_col = src - start + (WIDTH - 1)
        hv = tl.load(
            state_base + offs_d[:, None] * stride_s_d + hist_col[None, :] * stride_s_k,
            mask=mask_d_init[:, None] & in_hist & (~from_x), other=0.0,
        )  # fmt: skip
        new_hist = xv.to(tl.float32) + hv.to(tl.float32)
        tl.debug_barrier()  # every read of the old history precedes the overwrite
        tl.store(
            state_base + offs_d[:, None] * stride_s_d + offs_h[None, :] * stride_s_k,
            new_hist.to(states_ptr.dtype.element_ty), mask=mask_d_slot[:, None] & in_hist,
        )  # fmt: skip


@triton.jit
def _conv1d_update_kernel(
    x_ptr, w_ptr, bias_ptr, states_ptr, idx_ptr, out_ptr,
    dim,
    stride_x_b, stride_x_d, stride_w_d, stride_w_k,
    stride_s_s, stride_s_d, stride_s_k, stride_o_b, stride_o_d,
    PAD_SLOT: tl.constexpr, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    valid = slot != PAD_SLOT
    state_base = states_ptr + tl.where(valid, slot, 0) * stride_s_s

    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    mask_d = offs_d < dim
    mask_d_slot = tl.where(valid, mask_d, False)  # (BLOCK_D,) channels of a real slot
    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    x_row = x_ptr + row * stride_x_b + offs_d * stride_x_d
    state_rows = state_base + offs_d[:, None] * stride_s_d  # (BLOCK_D, 1)

    # Window column k < K - 1 is history column k; column K - 1 is the new input.
    mask_hist = mask_d_slot[:, None] & (offs_k < WIDTH - 1)[None, :]  # (BLOCK_D, BLOCK_K)
    hist = tl.load(state_rows + offs_k[None, :] * stride_s_k, mask=mask_hist, other=0.0)
    xv = tl.load(x_row, mask=mask_d, other=0.0).to(tl.float32)  # (BLOCK_D,)
    is_new = (offs_k == WIDTH - 1)[None, :]
    window = tl.where(is_new, xv[:, None], hist.to(tl.float32))  # (BLOCK_D, BLOCK_K)
    mask_w = mask_d[:, None] & (offs_k < WIDTH)[None, :]
    w = tl.load(
        w_ptr + offs_d[:, None] * stride_w_d + offs_k[None, :] * stride_w_k,
        mask=mask_w, other=0.0,
    )  # fmt: skip
    acc = tl.sum(window * w.to(tl.float32), axis=1)  # (BLOCK_D,)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if ACTIVATION:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + row * stride_o_b + offs_d * stride_o_d, acc.to(out_ptr.dtype.element_ty),
             mask=mask_d)  # fmt: skip

    if WIDTH > 1:
        # New history column j is window column j + 1.
        mask_shift = mask_d_slot[:, None] & (offs_k < WIDTH - 2)[None, :]
        shifted = tl.load(state_rows + (offs_k[None, :] + 1) * stride_s_k, mask=mask_shift,
                          other=0.0)  # fmt: skip
        new_hist = tl.where((offs_k == WIDTH - 2)[None, :], xv[:, None], shifted.to(tl.float32))
        tl.debug_barrier()  # every read of the old history precedes the overwrite
        mask_store = mask_d_slot[:, None] & (offs_k < WIDTH - 1)[None, :]
        tl.store(state_rows + offs_k[None, :] * stride_s_k,
                 new_hist.to(states_ptr.dtype.element_ty), mask=mask_store)  # fmt: skip


def _block_d(dim: int) -> int:
    return min(_MAX_BLOCK_D, triton.next_power_of_2(dim))


def causal_conv1d_varlen(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
    query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    activation: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `causal_conv1d_varlen_ref` (see there for the arguments).

    Returns:
        `(T, D)` outputs in the dtype of `x`; `conv_states` is updated in place.
    """
    num_tokens, dim = x.shape
    width = weight.shape[1]
    batch = state_indices.shape[0]
    out = torch.empty_like(x)  # (T, D)
    if num_tokens == 0 or batch == 0:
        return out
    block_d = _block_d(dim)
    grid = (batch, triton.cdiv(dim, block_d))
    _conv1d_varlen_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_states,
        query_start_loc, state_indices, has_initial_state, out,
        dim,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        out.stride(0), out.stride(1),
        PAD_SLOT=PAD_SLOT_ID, WIDTH=width, HAS_BIAS=bias is not None,
        ACTIVATION=activation, BLOCK_T=_BLOCK_T, BLOCK_D=block_d,
        BLOCK_H=triton.next_power_of_2(max(width - 1, 1)),
    )  # fmt: skip
    return out


def causal_conv1d_update(
    x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    state_indices: torch.Tensor, activation: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `causal_conv1d_update_ref`; no host syncs, so CUDA-graph capturable.

    Returns:
        `(B, D)` outputs in the dtype of `x`; padding rows get the output of an empty history.
    """
    batch, dim = x.shape
    width = weight.shape[1]
    out = torch.empty_like(x)  # (B, D)
    if batch == 0:
        return out
    block_d = _block_d(dim)
    grid = (batch, triton.cdiv(dim, block_d))
    _conv1d_update_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_states, state_indices, out,
        dim,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        out.stride(0), out.stride(1),
        PAD_SLOT=PAD_SLOT_ID, WIDTH=width, HAS_BIAS=bias is not None,
        ACTIVATION=activation, BLOCK_D=block_d, BLOCK_K=triton.next_power_of_2(width),
    )  # fmt: skip
    return out
