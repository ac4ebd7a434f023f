"""Triton kernels for Mamba's selective scan: varlen prefill and one-token decode update.

Same signatures and semantics as `selective_scan_varlen_ref` / `selective_state_update_ref` in
`vllm_mamba.ops.selective_scan`. Math is float32; inputs may be float32, bfloat16 or float16,
and `ssm_states` float32 or a low-precision dtype.

Glossary (token-major layout):
    T: tokens; B: sequences (or decode rows); D: channels; N: state size; S: state slots.
    u, dt, z: `(T, D)`; A: `(D, N)`; B_, C: `(T, N)`; D_skip, dt_bias: `(D,)`;
    ssm_states: `(S, D, N)`. Rows whose slot is `PAD_SLOT_ID` never touch `ssm_states`.
    One program owns one sequence (or decode row) and `BLOCK_D` channels, with its
    `(BLOCK_D, N)` state in registers; the varlen scan walks that sequence's tokens in order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mamba.cache_specs import PAD_SLOT_ID

_MAX_BLOCK_D = 32


@triton.jit
def _selective_scan_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, states_ptr,
    qsl_ptr, idx_ptr, init_ptr, out_ptr,
    dim, nstate,
    stride_u_t, stride_u_d, stride_dt_t, stride_dt_d, stride_A_d, stride_A_n,
    stride_B_t, stride_B_n, stride_C_t, stride_C_n, stride_z_t, stride_z_d,
    stride_s_s, stride_s_d, stride_s_n, stride_o_t, stride_o_d,
    PAD_SLOT: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Scans tokens [start, end) of one sequence; decode is the case end = start + 1."""
    seq = tl.program_id(0)
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

    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask_d = offs_d < dim
    mask_n = offs_n < nstate
    mask_dn = mask_d[:, None] & mask_n[None, :]  # (BLOCK_D, BLOCK_N)

    A = tl.load(A_ptr + offs_d[:, None] * stride_A_d + offs_n[None, :] * stride_A_n,
                mask=mask_dn, other=0.0).to(tl.float32)  # fmt: skip
    dt_bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    D_skip = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_D:
        D_skip = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)

    state_ptrs = (
        states_ptr + tl.where(valid, slot, 0) * stride_s_s
        + offs_d[:, None] * stride_s_d + offs_n[None, :] * stride_s_n
    )  # fmt: skip
    # Scalar conditions folded into channel masks (the interpreter mistypes tensor & scalar).
    mask_init = tl.where(use_init, mask_d, False)[:, None] & mask_n[None, :]
    mask_slot = tl.where(valid, mask_d, False)[:, None] & mask_n[None, :]
    h = tl.load(state_ptrs, mask=mask_init, other=0.0).to(tl.float32)

    for t in range(start, end):
        u = tl.load(u_ptr + t * stride_u_t + offs_d * stride_u_d, mask=mask_d, other=0.0)
        u = u.to(tl.float32)  # (BLOCK_D,)
        dt = tl.load(dt_ptr + t * stride_dt_t + offs_d * stride_dt_d, mask=mask_d, other=0.0)
        dt = dt.to(tl.float32) + dt_bias
        if DT_SOFTPLUS:
            # softplus with torch's threshold; exp(dt) alone where log(1 + exp) would round.
            soft = tl.where(dt < -15.0, tl.exp(dt), tl.log(1.0 + tl.exp(dt)))
            dt = tl.where(dt > 20.0, dt, soft)
        B = tl.load(B_ptr + t * stride_B_t + offs_n * stride_B_n, mask=mask_n, other=0.0)
        C = tl.load(C_ptr + t * stride_C_t + offs_n * stride_C_n, mask=mask_n, other=0.0)
        dA = tl.exp(A * dt[:, None])  # (BLOCK_D, BLOCK_N)
        dBu = (dt * u)[:, None] * B.to(tl.float32)[None, :]  # (BLOCK_D, BLOCK_N)
        h = dA * h + dBu
        y = tl.sum(h * C.to(tl.float32)[None, :], axis=1)  # (BLOCK_D,)
        if HAS_D:
            y += u * D_skip
        if HAS_Z:
            z = tl.load(z_ptr + t * stride_z_t + offs_d * stride_z_d, mask=mask_d, other=0.0)
            z = z.to(tl.float32)
            y = y * z * tl.sigmoid(z)
        tl.store(out_ptr + t * stride_o_t + offs_d * stride_o_d,
                 y.to(out_ptr.dtype.element_ty), mask=mask_d)  # fmt: skip

    tl.store(state_ptrs, h.to(states_ptr.dtype.element_ty), mask=mask_slot)


def _launch(
    u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B_: torch.Tensor, C: torch.Tensor,
    D_skip: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
    dt_softplus: bool, ssm_states: torch.Tensor, query_start_loc: torch.Tensor | None,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """Runs the scan kernel: varlen when `query_start_loc` is given, else one token per row."""
    dim, nstate = A.shape
    batch = state_indices.shape[0]
    out = torch.empty_like(u)  # (T, D)
    if u.shape[0] == 0 or batch == 0:
        return out
    block_d = min(_MAX_BLOCK_D, triton.next_power_of_2(dim))
    grid = (batch, triton.cdiv(dim, block_d))
    z_arg = z if z is not None else u
    _selective_scan_kernel[grid](
        u, dt, A, B_, C, D_skip if D_skip is not None else u, z_arg,
        dt_bias if dt_bias is not None else u, ssm_states,
        query_start_loc if query_start_loc is not None else state_indices,
        state_indices,
        has_initial_state if has_initial_state is not None else state_indices,
        out,
        dim, nstate,
        u.stride(0), u.stride(1), dt.stride(0), dt.stride(1), A.stride(0), A.stride(1),
        B_.stride(0), B_.stride(1), C.stride(0), C.stride(1), z_arg.stride(0), z_arg.stride(1),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2),
        out.stride(0), out.stride(1),
        PAD_SLOT=PAD_SLOT_ID, IS_VARLEN=query_start_loc is not None,
        HAS_D=D_skip is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus, BLOCK_D=block_d, BLOCK_N=triton.next_power_of_2(nstate),
    )  # fmt: skip
    return out


def selective_scan_varlen(
    u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B_: torch.Tensor, C: torch.Tensor,
    D_skip: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
    dt_softplus: bool, ssm_states: torch.Tensor, query_start_loc: torch.Tensor,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `selective_scan_varlen_ref` (see there for the arguments).

    Returns:
        `(T, D)` outputs in the dtype of `u`; `ssm_states` is updated in place.
    """
    return _launch(
        u, dt, A, B_, C, D_skip, z, dt_bias, dt_softplus, ssm_states,
        query_start_loc, state_indices, has_initial_state,
    )  # fmt: skip


def selective_state_update(
    ssm_states: torch.Tensor, u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B_: torch.Tensor,
    C: torch.Tensor, D_skip: torch.Tensor | None, z: torch.Tensor | None,
    dt_bias: torch.Tensor | None, dt_softplus: bool, state_indices: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `selective_state_update_ref`; no host syncs, so CUDA-graph capturable.

    Returns:
        `(B, D)` outputs in the dtype of `u`; padding rows get the output of a zero state.
    """
    return _launch(
        u, dt, A, B_, C, D_skip, z, dt_bias, dt_softplus, ssm_states,
        None, state_indices, None,
    )  # fmt: skip
