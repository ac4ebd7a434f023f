"""Triton kernels for the Kimi Delta Attention ops: the varlen rule, its one-token update and
the sigmoid-gated RMSNorm, registered as the `triton` backend's versions of the `kda` family.

Same signatures and semantics as `kda_varlen_ref`, `kda_update_ref` and `kda_norm_gate_ref` in
`vllm_mamba.ops.kda` (read its docstring for the math). The gates (Kimi's softplus gate where
`lower_bound == 0`, the safe gate `lower_bound * sigmoid(exp(A_log) * (a + dt_bias))` where it
is negative; beta's sigmoid), the L2 norms of q and k and the query scale are computed in the
kernels (the gate chosen at compile time, `SAFE_GATE`); math is float32, inputs
may be float32, bfloat16 or float16, `ssm_states` float32 or bfloat16. No launcher reads device
data on the host, so each can be captured in a CUDA graph.

The varlen kernel runs the RECURRENT form, token by token, not the chunked one: each program
keeps its `(Dk, BLOCK_V)` state in float32 registers and applies `S = diag(exp(g)) S`, the
delta update and the readout per token. It is exact for any `chunk_size` (which it ignores)
and needs no pairwise decay factors, so no exp of a difference of large cumulative sums. (A
chunked Triton form would need `(Q, Q, Dk)` pairwise factors per chunk; left for later.)

Glossary (token-major layout, as the references):
    T: tokens; B: sequences (or decode rows); S: state slots; Hk / Hv: key / value heads (value
    head `h` reads key head `h // (Hv / Hk)`); Dk, Dv: head dims.
    q, k: `(T, Hk, Dk)`; v: `(T, Hv, Dv)`; a: `(T, Hv * Dk)`; b: `(T, Hv)`; A_log: `(Hv,)`;
    dt_bias: `(Hv * Dk,)`; ssm_states: `(S, Hv, Dk, Dv)`. Rows whose slot is `PAD_SLOT_ID` never
    touch `ssm_states`. One program owns one sequence (or decode row), one value head and
    `BLOCK_V` columns of the value dim: every column of the rule depends only on the same
    column of v and of the state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.kda import CHUNK_SIZE, check_lower_bound
from vllm_mamba.ops.triton_gated_delta import _l2_normalise
from vllm_mamba.ops.triton_ssd import _softplus

_MAX_BLOCK_V = 32
_BLOCK_ROWS_NORM = 16


@triton.jit
def _kda_token(
    S, t, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, offs_k, mask_k, offs_v, mask_v, key_head, head,
    rate, dt_bias, q_scale, lower_bound,
    stride_q_t, stride_q_h, stride_q_d, stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d, stride_a_t, stride_a_c, stride_b_t, stride_b_h,
    key_dim, SAFE_GATE: tl.constexpr,
):  # fmt: skip
    """One token of the rule on the `(BLOCK_K, BLOCK_V)` state: returns `(S, o (BLOCK_V,))`.
    `rate` is `exp(A_log[head])`; `SAFE_GATE` selects `lower_bound * sigmoid(rate * x)` over
    `-rate * softplus(x)`."""
    q = tl.load(q_ptr + t * stride_q_t + key_head * stride_q_h + offs_k * stride_q_d,
                mask=mask_k, other=0.0).to(tl.float32)  # fmt: skip
    k = tl.load(k_ptr + t * stride_k_t + key_head * stride_k_h + offs_k * stride_k_d,
                mask=mask_k, other=0.0).to(tl.float32)  # fmt: skip
    v = tl.load(v_ptr + t * stride_v_t + head * stride_v_h + offs_v * stride_v_d,
                mask=mask_v, other=0.0).to(tl.float32)  # fmt: skip
    a = tl.load(a_ptr + t * stride_a_t + (head * key_dim + offs_k) * stride_a_c,
                mask=mask_k, other=0.0).to(tl.float32)  # fmt: skip
    b = tl.load(b_ptr + t * stride_b_t + head * stride_b_h).to(tl.float32)
    q = _l2_normalise(q, q_scale)  # (BLOCK_K,)
    k = _l2_normalise(k, 1.0)  # (BLOCK_K,)
    x = a + dt_bias
    if SAFE_GATE:
        g = lower_bound * tl.sigmoid(rate * x)
    else:
        g = -rate * _softplus(x)
    g = tl.where(mask_k, g, 0.0)  # (BLOCK_K,) log decay
    beta = tl.sigmoid(b)
    S = S * tl.exp(g)[:, None]
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta  # (BLOCK_V,)
    S += k[:, None] * delta[None, :]
    return S, tl.sum(S * q[:, None], axis=0)


@triton.jit
def _kda_varlen_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, states_ptr,
    qsl_ptr, idx_ptr, init_ptr, out_ptr,
    key_dim, value_dim, heads_per_key, q_scale,
    stride_q_t, stride_q_h, stride_q_d, stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d, stride_a_t, stride_a_c, stride_b_t, stride_b_h,
    stride_alog, stride_bias, stride_s_s, stride_s_h, stride_s_k, stride_s_v,
    stride_o_t, stride_o_h, stride_o_v, lower_bound,
    PAD_SLOT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    SAFE_GATE: tl.constexpr,
):  # fmt: skip
    """Runs the rule over tokens [start, end) of one sequence and value head, token by token."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(qsl_ptr + seq)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    valid = slot != PAD_SLOT
    end = tl.where(valid, tl.load(qsl_ptr + seq + 1), start)  # padding rows run no token
    use_init = valid & (tl.load(init_ptr + seq) != 0)
    key_head = head // heads_per_key

    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    mask_k = offs_k < key_dim
    mask_v = offs_v < value_dim
    rate = tl.exp(tl.load(A_log_ptr + head * stride_alog).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + (head * key_dim + offs_k) * stride_bias, mask=mask_k,
                      other=0.0).to(tl.float32)  # fmt: skip

    state_ptrs = (
        states_ptr + tl.where(valid, slot, 0) * stride_s_s + head * stride_s_h
        + offs_k[:, None] * stride_s_k + offs_v[None, :] * stride_s_v
    )  # fmt: skip
    # Scalar conditions folded into row masks (the interpreter mistypes tensor & scalar).
    mask_init = tl.where(use_init, mask_k, False)[:, None] & mask_v[None, :]
    S = tl.load(state_ptrs, mask=mask_init, other=0.0).to(tl.float32)  # (BLOCK_K, BLOCK_V)
    out_cols = out_ptr + head * stride_o_h + offs_v * stride_o_v  # (BLOCK_V,)
    for t in range(start, end):
        S, o = _kda_token(
            S, t, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, offs_k, mask_k, offs_v, mask_v, key_head,
            head, rate, dt_bias, q_scale, lower_bound,
            stride_q_t, stride_q_h, stride_q_d, stride_k_t, stride_k_h, stride_k_d,
            stride_v_t, stride_v_h, stride_v_d, stride_a_t, stride_a_c, stride_b_t, stride_b_h,
            key_dim, SAFE_GATE,
        )  # fmt: skip
        tl.store(out_cols + t * stride_o_t, o.to(out_ptr.dtype.element_ty), mask=mask_v)

    # Empty sequences and padding rows leave their slot untouched, as the reference does.
    mask_store = tl.where(end > start, mask_k, False)[:, None] & mask_v[None, :]
    tl.store(state_ptrs, S.to(states_ptr.dtype.element_ty), mask=mask_store)


@triton.jit
def _kda_update_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, states_ptr, idx_ptr, out_ptr,
    key_dim, value_dim, heads_per_key, q_scale,
    stride_q_t, stride_q_h, stride_q_d, stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d, stride_a_t, stride_a_c, stride_b_t, stride_b_h,
    stride_alog, stride_bias, stride_s_s, stride_s_h, stride_s_k, stride_s_v,
    stride_o_t, stride_o_h, stride_o_v, lower_bound,
    PAD_SLOT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    SAFE_GATE: tl.constexpr,
):  # fmt: skip
    """Advances the state of one decode row and value head by its token."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    valid = slot != PAD_SLOT
    key_head = head // heads_per_key

    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    mask_k = offs_k < key_dim
    mask_v = offs_v < value_dim
    rate = tl.exp(tl.load(A_log_ptr + head * stride_alog).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + (head * key_dim + offs_k) * stride_bias, mask=mask_k,
                      other=0.0).to(tl.float32)  # fmt: skip

    state_ptrs = (
        states_ptr + tl.where(valid, slot, 0) * stride_s_s + head * stride_s_h
        + offs_k[:, None] * stride_s_k + offs_v[None, :] * stride_s_v
    )  # fmt: skip
    # Scalar condition folded into the row mask (the interpreter mistypes tensor & scalar).
    mask_slot = tl.where(valid, mask_k, False)[:, None] & mask_v[None, :]
    S = tl.load(state_ptrs, mask=mask_slot, other=0.0).to(tl.float32)  # (BLOCK_K, BLOCK_V)
    S, o = _kda_token(
        S, row, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, offs_k, mask_k, offs_v, mask_v, key_head,
        head, rate, dt_bias, q_scale, lower_bound,
        stride_q_t, stride_q_h, stride_q_d, stride_k_t, stride_k_h, stride_k_d,
        stride_v_t, stride_v_h, stride_v_d, stride_a_t, stride_a_c, stride_b_t, stride_b_h,
        key_dim, SAFE_GATE,
    )  # fmt: skip
    o = tl.where(valid, o, 0.0)  # (BLOCK_V,) zeros for padding
    tl.store(out_ptr + row * stride_o_t + head * stride_o_h + offs_v * stride_o_v,
             o.to(out_ptr.dtype.element_ty), mask=mask_v)  # fmt: skip
    tl.store(state_ptrs, S.to(states_ptr.dtype.element_ty), mask=mask_slot)


@triton.jit
def _kda_norm_gate_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr, num_rows, dim, eps,
    stride_x_r, stride_x_d, stride_z_r, stride_z_d, stride_w, stride_o_r, stride_o_d,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """`weight * rmsnorm(x) * sigmoid(z)` for `BLOCK_R` rows, in float32, rounded once."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    mask = (offs_r < num_rows)[:, None] & (offs_d < dim)[None, :]  # (BLOCK_R, BLOCK_D)
    rows = offs_r[:, None]
    x = tl.load(x_ptr + rows * stride_x_r + offs_d[None, :] * stride_x_d, mask=mask, other=0.0)
    z = tl.load(z_ptr + rows * stride_z_r + offs_d[None, :] * stride_z_d, mask=mask, other=0.0)
    w = tl.load(w_ptr + offs_d * stride_w, mask=offs_d < dim, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / dim + eps)  # (BLOCK_R,)
    out = w[None, :] * (xf * rstd[:, None]) * tl.sigmoid(z.to(tl.float32))
    out_ptrs = out_ptr + rows * stride_o_r + offs_d[None, :] * stride_o_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_args(q, k, v, a, b, A_log, dt_bias, ssm_states, out, lower_bound) -> tuple:
    """The value and stride arguments both rule kernels take, in their order (a `(T, Hv * Dk)`,
    A_log and dt_bias flat; `lower_bound` checked)."""
    key_dim = q.shape[2]
    return (
        key_dim, v.shape[2], v.shape[1] // q.shape[1], key_dim**-0.5,
        *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(),
        A_log.stride(0), dt_bias.stride(0), *ssm_states.stride(), *out.stride(),
        check_lower_bound(lower_bound),
    )  # fmt: skip


def _flat_params(
    a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """a as `(T, Hv * Dk)`, A_log `(Hv,)` and dt_bias `(Hv * Dk,)` (views where possible)."""
    return a.reshape(a.shape[0], -1), A_log.reshape(-1), dt_bias.reshape(-1)


def kda_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE, lower_bound: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `kda_varlen_ref` (see there for the arguments); the kernel runs the
    recurrent form, so `chunk_size` is accepted and ignored. `lower_bound`: 0 for Kimi's
    softplus gate, negative for the safe gate.

    Returns:
        `(T, Hv, Dv)` outputs in q's dtype (zeros for padding rows' tokens); `ssm_states` is
        updated in place.

    Raises:
        ValueError: a positive `lower_bound`.
    """
    del chunk_size
    lower_bound = check_lower_bound(lower_bound)
    num_v_heads, value_dim = v.shape[1:]
    batch = state_indices.shape[0]
    out = torch.zeros(v.shape, dtype=q.dtype, device=v.device)  # (T, Hv, Dv)
    if v.shape[0] == 0 or batch == 0:
        return out
    a, A_log, dt_bias = _flat_params(a, A_log, dt_bias)
    block_v = min(_MAX_BLOCK_V, triton.next_power_of_2(value_dim))
    grid = (batch, num_v_heads, triton.cdiv(value_dim, block_v))
    _kda_varlen_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, ssm_states,
        query_start_loc, state_indices, has_initial_state, out,
        *_launch_args(q, k, v, a, b, A_log, dt_bias, ssm_states, out, lower_bound),
        PAD_SLOT=PAD_SLOT_ID, BLOCK_K=triton.next_power_of_2(q.shape[2]), BLOCK_V=block_v,
        SAFE_GATE=lower_bound < 0.0,
    )  # fmt: skip
    return out


def kda_update(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor,
    state_indices: torch.Tensor, lower_bound: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `kda_update_ref` (see there for the arguments); `lower_bound`: 0 for
    Kimi's softplus gate, negative for the safe gate.

    Returns:
        `(B, Hv, Dv)` outputs in q's dtype (zeros for padding rows); `ssm_states` is updated in
        place.

    Raises:
        ValueError: a positive `lower_bound`.
    """
    lower_bound = check_lower_bound(lower_bound)
    batch, num_v_heads, value_dim = v.shape
    out = torch.empty(v.shape, dtype=q.dtype, device=v.device)  # (B, Hv, Dv)
    if batch == 0:
        return out
    a, A_log, dt_bias = _flat_params(a, A_log, dt_bias)
    block_v = min(_MAX_BLOCK_V, triton.next_power_of_2(value_dim))
    grid = (batch, num_v_heads, triton.cdiv(value_dim, block_v))
    _kda_update_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, ssm_states, state_indices, out,
        *_launch_args(q, k, v, a, b, A_log, dt_bias, ssm_states, out, lower_bound),
        PAD_SLOT=PAD_SLOT_ID, BLOCK_K=triton.next_power_of_2(q.shape[2]), BLOCK_V=block_v,
        SAFE_GATE=lower_bound < 0.0,
    )  # fmt: skip
    return out


def kda_norm_gate(
    o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `kda_norm_gate_ref` (see there for the arguments).

    Returns:
        `(..., Dv)` in o's dtype.
    """
    dim = o.shape[-1]
    x2, z2 = o.reshape(-1, dim), gate.reshape(-1, dim)  # (rows, Dv), views where possible
    out = torch.empty(o.shape, dtype=o.dtype, device=o.device)
    out2 = out.view(-1, dim)  # (rows, Dv)
    num_rows = x2.shape[0]
    if num_rows == 0:
        return out
    _kda_norm_gate_kernel[(triton.cdiv(num_rows, _BLOCK_ROWS_NORM),)](
        x2, z2, weight, out2, num_rows, dim, float(eps),
        *x2.stride(), *z2.stride(), weight.stride(0), *out2.stride(),
        BLOCK_R=_BLOCK_ROWS_NORM, BLOCK_D=triton.next_power_of_2(dim),
    )  # fmt: skip
    return out
