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
    Q: tokens per chunk of the kernel; l / s: positions inside a chunk (target / source).
    One program owns one sequence (or decode row), one head and `BLOCK_P` rows of the head
    dim, with its `(BLOCK_P, N)` state in registers. Per token and head:
    h = exp(dt * A) * h + dt * x (outer) B, y = h @ C + D * x.
    The varlen scan walks its sequence in chunks of Q tokens from the sequence's first token;
    in each chunk (four `tl.dot`), with cum the running sum of dt * A:
        y[l] = sum_{s <= l} (C[l] . B[s]) exp(cum[l] - cum[s]) dt[s] x[s]
               + exp(cum[l]) C[l] . h_start + D x[l],
        h_end = exp(cum[-1]) h_start + sum_s exp(cum[-1] - cum[s]) dt[s] x[s] (outer) B[s].
    This is exact for any chunk size, so the kernel's Q need not be the model's `chunk_size`.
    The decode update is the one-token step, elementwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mamba.cache_specs import PAD_SLOT_ID

_BLOCK_Q = 32  # tokens per chunk of the varlen scan
_MAX_BLOCK_P_SCAN = 32
_MAX_BLOCK_P_UPDATE = 16


@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20), with log1p computed accurately for tiny exp(-|x|)."""
    e = tl.exp(-tl.abs(x))
    u = 1.0 + e
    exact = u != 1.0  # where 1 + e rounds to 1, log1p(e) is e
    log1p_e = tl.where(exact, tl.log(u) * (e / tl.where(exact, u - 1.0, 1.0)), e)
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p_e)


@triton.jit
def _time_step(dt, dt_bias, dt_min, dt_max, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr):
    """`dt + dt_bias`, then softplus and the clamp to `[dt_min, dt_max]` when asked, in float32."""
    dt = dt.to(tl.float32) + dt_bias
    if DT_SOFTPLUS:
        dt = _softplus(dt)
    if HAS_DT_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    return dt


@triton.jit
def _ssd_chunked_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, states_ptr,
    qsl_ptr, idx_ptr, init_ptr, out_ptr,
    head_dim, nstate, heads_per_group, dt_min, dt_max,
    stride_x_t, stride_x_h, stride_x_p, stride_dt_t, stride_dt_h,
    stride_A, stride_D, stride_bias,
    stride_B_t, stride_B_g, stride_B_n, stride_C_t, stride_C_g, stride_C_n,
    stride_s_s, stride_s_h, stride_s_p, stride_s_n, stride_o_t, stride_o_h, stride_o_p,
    PAD_SLOT: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Scans tokens [start, end) of one sequence and head, `BLOCK_Q` tokens at a time."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    valid = slot != PAD_SLOT
    use_init = valid & (tl.load(init_ptr + seq) != 0)
    group = head // heads_per_group

    offs_q = tl.arange(0, BLOCK_Q)  # (Q,)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask_p = offs_p < head_dim
    mask_n = offs_n < nstate
    causal = offs_q[:, None] >= offs_q[None, :]  # (Q, Q) target l >= source s

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

    x_cols = x_ptr + head * stride_x_h + offs_p[None, :] * stride_x_p  # (1, BLOCK_P)
    B_cols = B_ptr + group * stride_B_g + offs_n[None, :] * stride_B_n  # (1, BLOCK_N)
    C_cols = C_ptr + group * stride_C_g + offs_n[None, :] * stride_C_n  # (1, BLOCK_N)
    out_cols = out_ptr + head * stride_o_h + offs_p[None, :] * stride_o_p  # (1, BLOCK_P)
    for c0 in range(start, end, BLOCK_Q):
        offs_t = c0 + offs_q  # (Q,)
        mask_t = offs_t < end
        mask_tp = mask_t[:, None] & mask_p[None, :]  # (Q, BLOCK_P)
        mask_tn = mask_t[:, None] & mask_n[None, :]  # (Q, BLOCK_N)
        dt = tl.load(dt_ptr + offs_t * stride_dt_t + head * stride_dt_h, mask=mask_t, other=0.0)
        dt = _time_step(dt, dt_bias, dt_min, dt_max, DT_SOFTPLUS, HAS_DT_LIMIT)
        dt = tl.where(mask_t, dt, 0.0)  # (Q,) tokens past the end leave the state alone
        cum = tl.cumsum(dt * A, axis=0)  # (Q,) log decay from the chunk start
        rows = offs_t[:, None]  # (Q, 1)
        x = tl.load(x_cols + rows * stride_x_t, mask=mask_tp, other=0.0).to(tl.float32)
        B = tl.load(B_cols + rows * stride_B_t, mask=mask_tn, other=0.0).to(tl.float32)
        C = tl.load(C_cols + rows * stride_C_t, mask=mask_tn, other=0.0).to(tl.float32)
        xdt = x * dt[:, None]  # (Q, BLOCK_P)

        # Inside the chunk: y[l] = sum_{s <= l} (C[l] . B[s]) exp(cum[l] - cum[s]) xdt[s].
        seg = tl.where(causal, cum[:, None] - cum[None, :], 0.0)  # (Q, Q)
        scores = tl.dot(C, tl.trans(B), input_precision="ieee")  # (Q, Q)
        scores = tl.where(causal, scores * tl.exp(seg), 0.0)
        y = tl.dot(scores, xdt, input_precision="ieee")  # (Q, BLOCK_P)
        # Plus the state at the chunk start, decayed to each token.
        y += tl.dot(C, tl.trans(h), input_precision="ieee") * tl.exp(cum)[:, None]
        if HAS_D:
            y += D_skip * x
        tl.store(out_cols + rows * stride_o_t, y.to(out_ptr.dtype.element_ty), mask=mask_tp)

        # The state at the chunk end: the start state decayed, plus each token decayed to it.
        total = tl.sum(dt * A, axis=0)
        to_end = tl.exp(total - cum)  # (Q,)
        h = h * tl.exp(total) + tl.dot(
            tl.trans(xdt * to_end[:, None]), B, input_precision="ieee"
        )  # (BLOCK_P, BLOCK_N)

    tl.store(state_ptrs, h.to(states_ptr.dtype.element_ty), mask=mask_slot)


@triton.jit
def _ssd_update_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, states_ptr, idx_ptr, out_ptr,
    head_dim, nstate, heads_per_group,
    stride_x_t, stride_x_h, stride_x_p, stride_dt_t, stride_dt_h,
    stride_A, stride_D, stride_bias,
    stride_B_t, stride_B_g, stride_B_n, stride_C_t, stride_C_g, stride_C_n,
    stride_s_s, stride_s_h, stride_s_p, stride_s_n, stride_o_t, stride_o_h, stride_o_p,
    PAD_SLOT: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Advances the state of one decode row and head by its token."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    valid = slot != PAD_SLOT
    group = head // heads_per_group

    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask_p = offs_p < head_dim
    mask_n = offs_n < nstate

    A = tl.load(A_ptr + head * stride_A).to(tl.float32)
    dt_bias = 0.0
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + head * stride_bias).to(tl.float32)
    dt = tl.load(dt_ptr + row * stride_dt_t + head * stride_dt_h)
    dt = _time_step(dt, dt_bias, 0.0, 0.0, DT_SOFTPLUS, False)

    state_ptrs = (
        states_ptr + tl.where(valid, slot, 0) * stride_s_s + head * stride_s_h
        + offs_p[:, None] * stride_s_p + offs_n[None, :] * stride_s_n
    )  # fmt: skip
    # Scalar condition folded into the row mask (the interpreter mistypes tensor & scalar).
    mask_slot = tl.where(valid, mask_p, False)[:, None] & mask_n[None, :]
    h = tl.load(state_ptrs, mask=mask_slot, other=0.0).to(tl.float32)  # (BLOCK_P, BLOCK_N)

    x = tl.load(x_ptr + row * stride_x_t + head * stride_x_h + offs_p * stride_x_p, mask=mask_p,
                other=0.0).to(tl.float32)  # fmt: skip
    B = tl.load(B_ptr + row * stride_B_t + group * stride_B_g + offs_n * stride_B_n, mask=mask_n,
                other=0.0).to(tl.float32)  # fmt: skip
    C = tl.load(C_ptr + row * stride_C_t + group * stride_C_g + offs_n * stride_C_n, mask=mask_n,
                other=0.0).to(tl.float32)  # fmt: skip
    h = tl.exp(dt * A) * h + (dt * x)[:, None] * B[None, :]
    y = tl.sum(h * C[None, :], axis=1)  # (BLOCK_P,)
    if HAS_D:
        y += tl.load(D_ptr + head * stride_D).to(tl.float32) * x
    tl.store(out_ptr + row * stride_o_t + head * stride_o_h + offs_p * stride_o_p,
             y.to(out_ptr.dtype.element_ty), mask=mask_p)  # fmt: skip
    tl.store(state_ptrs, h.to(states_ptr.dtype.element_ty), mask=mask_slot)


def _strides(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, D_skip: torch.Tensor | None,
    dt_bias: torch.Tensor | None, B_: torch.Tensor, C: torch.Tensor, ssm_states: torch.Tensor,
    out: torch.Tensor,
) -> tuple[int, ...]:  # fmt: skip
    """The stride arguments both kernels take, in their order."""
    return (
        *x.stride(), *dt.stride(), A.stride(0),
        D_skip.stride(0) if D_skip is not None else 0,
        dt_bias.stride(0) if dt_bias is not None else 0,
        *B_.stride(), *C.stride(), *ssm_states.stride(), *out.stride(),
    )  # fmt: skip


def ssd_chunk_scan_varlen(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B_: torch.Tensor, C: torch.Tensor,
    D_skip: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,
    dt_limit: tuple[float, float], ssm_states: torch.Tensor, query_start_loc: torch.Tensor,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor, chunk_size: int,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `ssd_chunk_scan_varlen_ref` (see there for the arguments).

    The kernel walks each sequence in chunks of its own size (`_BLOCK_Q`) from the sequence's
    first token; the chunked form is exact for any chunk size, so `chunk_size` only shapes the
    reference's rounding. Tokens after `query_start_loc[-1]` are not written.

    Returns:
        `(T, H, P)` outputs in the dtype of `x`; `ssm_states` is updated in place.
    """
    num_tokens, num_heads, head_dim = x.shape
    groups, nstate = B_.shape[1:]
    batch = state_indices.shape[0]
    out = torch.empty_like(x)  # (T, H, P)
    if num_tokens == 0 or batch == 0:
        return out
    # The reference clamps only when the limit can change a softplus output.
    has_limit = dt_limit[0] > 0.0 or dt_limit[1] != float("inf")
    # tl.dot needs every block dimension >= 16.
    block_p = max(16, min(_MAX_BLOCK_P_SCAN, triton.next_power_of_2(head_dim)))
    grid = (batch, num_heads, triton.cdiv(head_dim, block_p))
    _ssd_chunked_scan_kernel[grid](
        x, dt, A, B_, C, D_skip if D_skip is not None else A,
        dt_bias if dt_bias is not None else A, ssm_states,
        query_start_loc, state_indices, has_initial_state, out,
        head_dim, nstate, num_heads // groups,
        float(dt_limit[0]) if has_limit else 0.0, float(dt_limit[1]) if has_limit else 0.0,
        *_strides(x, dt, A, D_skip, dt_bias, B_, C, ssm_states, out),
        PAD_SLOT=PAD_SLOT_ID, HAS_D=D_skip is not None, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus, HAS_DT_LIMIT=has_limit, BLOCK_Q=_BLOCK_Q, BLOCK_P=block_p,
        BLOCK_N=max(16, triton.next_power_of_2(nstate)), num_warps=8,
    )  # fmt: skip
    return out


def ssd_state_update(
    ssm_states: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B_: torch.Tensor,
    C: torch.Tensor, D_skip: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,
    state_indices: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `ssd_state_update_ref` (see there for the arguments); dt is not clamped.

    Returns:
        `(B, H, P)` outputs in the dtype of `x`; padding rows get the output of a zero state.
    """
    batch, num_heads, head_dim = x.shape
    groups, nstate = B_.shape[1:]
    out = torch.empty_like(x)  # (B, H, P)
    if batch == 0:
        return out
    block_p = min(_MAX_BLOCK_P_UPDATE, triton.next_power_of_2(head_dim))
    grid = (batch, num_heads, triton.cdiv(head_dim, block_p))
    _ssd_update_kernel[grid](
        x, dt, A, B_, C, D_skip if D_skip is not None else A,
        dt_bias if dt_bias is not None else A, ssm_states, state_indices, out,
        head_dim, nstate, num_heads // groups,
        *_strides(x, dt, A, D_skip, dt_bias, B_, C, ssm_states, out),
        PAD_SLOT=PAD_SLOT_ID, HAS_D=D_skip is not None, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus, BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(nstate),
    )  # fmt: skip
    return out
