"""Triton kernels for Mamba2's SSD: the varlen chunked scan and the one-token decode update.

Same signatures and semantics as `ssd_chunk_scan_varlen_ref` / `ssd_state_update_ref` in
`vllm_mamba.ops.ssd`. Math is float32; inputs may be float32, bfloat16 or float16, and
`ssm_states` float32 or a low-precision dtype. Neither launcher reads device data on the host,
so both can be captured in a CUDA graph.

Glossary (token-major layout):
    T: tokens; B: sequences (or decode rows); H: heads; P: head dim; G: groups of B/C;
    N: state size; S: state slots.
    x: `(T, H, P)`; dt: `(T, H)`; A, D_skip, dt_bias: `(H,)`; B_, C: `(T, G, N)`, head `h`
    reading group `h // (H / G)`; ssm_states: `(S, H, P, N)`. Rows whose slot is
    `PAD_SLOT_ID` never touch `ssm_states`.
    One program owns one sequence (or decode row), one head and `BLOCK_P` rows of the head
    dim, with its `(BLOCK_P, N)` state in registers, and walks that sequence's tokens in order:
    h = exp(dt * A) * h + dt * x (outer) B, y = h @ C + D * x. This is the recurrence the
    chunked form computes, so the result does not depend on `chunk_size`, which only shapes
    the reference's rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mamba.mamba_cache import PAD_SLOT_ID

_MAX_BLOCK_P = 16


@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20), with log1p computed accurately for tiny exp(-|x|)."""
    e = tl.exp(-tl.abs(x))
    u = 1.0 + e
    exact = u != 1.0  # where 1 + e rounds to 1, log1p(e) is e
    log1p_e = tl.where(exact, tl.log(u) * (e / tl.where(exact, u - 1.0, 1.0)), e)
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p_e)


@triton.jit
def _ssd_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, states_ptr,
    qsl_ptr, idx_ptr, init_ptr, out_ptr,
    head_dim, nstate, heads_per_group, dt_min, dt_max,
    stride_x_t, stride_x_h, stride_x_p, stride_dt_t, stride_dt_h,
    stride_A, stride_D, stride_bias,
    stride_B_t, stride_B_g, stride_B_n, stride_C_t, stride_C_g, stride_C_n,
    stride_s_s, stride_s_h, stride_s_p, stride_s_n, stride_o_t, stride_o_h, stride_o_p,
    PAD_SLOT: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_D: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Scans tokens [start, end) of one sequence and head; decode is the case end = start + 1."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if IS_VARLEN:
        start = tl.load(qsl_ptr + seq)
        end = tl.load(qsl_ptr + seq + 1)
    else:
        start = seq
        end = seq + 1
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    valid = slot != PAD_SLOT
    use_init = valid
    if IS_VARLEN:
        use_init = valid & (tl.load(init_ptr + seq) != 0)
    group = head // heads_per_group

    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask_p = offs_p < head_dim
    mask_n = offs_n < nstate

    A = tl.load(A_ptr + head * stride_A).to(tl.float32)
    dt_bias = 0.0
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + head * stride_bias).to(tl.float32)
    D_skip = 0.0
    if HAS_D:
        D_skip = tl.load(D_ptr + head * stride_D).to(tl.float32)

    state_ptrs = (
        states_ptr + tl.where(valid, slot, 0) * stride_s_s + head * stride_s_h
        + offs_p[:, None] * stride_s_p + offs_n[None, :] * stride_s_n
    )  # fmt: skip
    # Scalar conditions folded into row masks (the interpreter mistypes tensor & scalar).
    mask_init = tl.where(use_init, mask_p, False)[:, None] & mask_n[None, :]
    mask_slot = tl.where(valid, mask_p, False)[:, None] & mask_n[None, :]
    h = tl.load(state_ptrs, mask=mask_init, other=0.0).to(tl.float32)  # (BLOCK_P, BLOCK_N)

    x_ptrs = x_ptr + head * stride_x_h + offs_p * stride_x_p  # (BLOCK_P,) at token 0
    B_ptrs = B_ptr + group * stride_B_g + offs_n * stride_B_n  # (BLOCK_N,) at token 0
    C_ptrs = C_ptr + group * stride_C_g + offs_n * stride_C_n  # (BLOCK_N,) at token 0
    out_ptrs = out_ptr + head * stride_o_h + offs_p * stride_o_p  # (BLOCK_P,) at token 0
    for t in range(start, end):
        x = tl.load(x_ptrs + t * stride_x_t, mask=mask_p, other=0.0).to(tl.float32)
        B = tl.load(B_ptrs + t * stride_B_t, mask=mask_n, other=0.0).to(tl.float32)
        C = tl.load(C_ptrs + t * stride_C_t, mask=mask_n, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * stride_dt_t + head * stride_dt_h).to(tl.float32) + dt_bias
        if DT_SOFTPLUS:
            dt = _softplus(dt)
        if HAS_DT_LIMIT:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        h = tl.exp(dt * A) * h + (dt * x)[:, None] * B[None, :]
        y = tl.sum(h * C[None, :], axis=1)  # (BLOCK_P,)
        if HAS_D:
            y += D_skip * x
        tl.store(out_ptrs + t * stride_o_t, y.to(out_ptr.dtype.element_ty), mask=mask_p)

    tl.store(state_ptrs, h.to(states_ptr.dtype.element_ty), mask=mask_slot)


def _launch(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B_: torch.Tensor,
    C: torch.Tensor,
    D_skip: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float] | None,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
) -> torch.Tensor:
    """Runs the scan kernel: varlen when `query_start_loc` is given, else one token per row."""
    num_tokens, num_heads, head_dim = x.shape
    groups, nstate = B_.shape[1], B_.shape[2]
    batch = state_indices.shape[0]
    out = torch.empty_like(x)  # (T, H, P)
    if num_tokens == 0 or batch == 0:
        return out
    # The reference clamps only when the limit can change a softplus output.
    has_limit = dt_limit is not None and (dt_limit[0] > 0.0 or dt_limit[1] != float("inf"))
    dt_min, dt_max = dt_limit if has_limit else (0.0, 0.0)
    block_p = min(_MAX_BLOCK_P, triton.next_power_of_2(head_dim))
    grid = (batch, num_heads, triton.cdiv(head_dim, block_p))
    _ssd_scan_kernel[grid](
        x, dt, A, B_, C, D_skip if D_skip is not None else A,
        dt_bias if dt_bias is not None else A, ssm_states,
        query_start_loc if query_start_loc is not None else state_indices,
        state_indices,
        has_initial_state if has_initial_state is not None else state_indices,
        out,
        head_dim, nstate, num_heads // groups, float(dt_min), float(dt_max),
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1),
        A.stride(0), D_skip.stride(0) if D_skip is not None else 0,
        dt_bias.stride(0) if dt_bias is not None else 0,
        B_.stride(0), B_.stride(1), B_.stride(2), C.stride(0), C.stride(1), C.stride(2),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), ssm_states.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        PAD_SLOT=PAD_SLOT_ID, IS_VARLEN=query_start_loc is not None,
        HAS_D=D_skip is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
        HAS_DT_LIMIT=has_limit, BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(nstate),
    )  # fmt: skip
    return out


def ssd_chunk_scan_varlen(
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
    """Triton twin of `ssd_chunk_scan_varlen_ref` (see there for the arguments).

    `chunk_size` is accepted for the shared signature; the token-by-token recurrence gives the
    chunked result for every chunk size. Tokens after `query_start_loc[-1]` are not written.

    Returns:
        `(T, H, P)` outputs in the dtype of `x`; `ssm_states` is updated in place.
    """
    return _launch(
        x, dt, A, B_, C, D_skip, dt_bias, dt_softplus, dt_limit, ssm_states,
        query_start_loc, state_indices, has_initial_state,
    )  # fmt: skip


def ssd_state_update(
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
    """Triton twin of `ssd_state_update_ref` (see there for the arguments); dt is not clamped.

    Returns:
        `(B, H, P)` outputs in the dtype of `x`; padding rows get the output of a zero state.
    """
    return _launch(
        x, dt, A, B_, C, D_skip, dt_bias, dt_softplus, None, ssm_states,
        None, state_indices, None,
    )  # fmt: skip
