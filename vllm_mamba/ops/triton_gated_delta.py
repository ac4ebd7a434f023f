"""Triton kernels for the Gated DeltaNet ops: the chunked varlen rule, its one-token update and
the gated RMSNorm, registered as the `triton` backend's versions of the `gated_delta` family.

Same signatures and semantics as `gated_delta_varlen_ref`, `gated_delta_update_ref` and
`rms_norm_gated_ref` in `vllm_mamba.ops.gated_delta` (read its docstring for the math). The
gates, the L2 norms of q and k and the query scale are computed in the kernels; math is float32,
inputs may be float32, bfloat16 or float16, `ssm_states` float32 or bfloat16. No launcher reads
device data on the host, so each can be captured in a CUDA graph.

Glossary (token-major layout, as the references):
    T: tokens; B: sequences (or decode rows); S: state slots; Hk / Hv: key / value heads (value
    head `h` reads key head `h // (Hv / Hk)`); Dk, Dv: head dims; Q: tokens per kernel chunk.
    q, k: `(T, Hk, Dk)`; v: `(T, Hv, Dv)`; a, b: `(T, Hv)`; A_log, dt_bias: `(Hv,)`;
    ssm_states: `(S, Hv, Dk, Dv)`. Rows whose slot is `PAD_SLOT_ID` never touch `ssm_states`.
    One program owns one sequence (or decode row), one value head and `BLOCK_V` columns of the
    value dim, with its `(Dk, BLOCK_V)` state in float32 registers: every column of the rule
    depends only on the same column of v and of the state.
    In each chunk of the varlen kernel, with c the cumulative log decay and S0 the chunk's start
    state: `T = (I + A)^-1` by forward substitution over rows, `W = T (beta exp(c) K)`,
    `U = T (beta V) - W S0`, `o = exp(c) Q S0 + (Q K^T * decay, causal) U` and
    `S = exp(c_Q) S0 + (K exp(c_Q - c))^T U`. The form is exact for any chunk size, so the
    kernel's Q only changes the rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.gated_delta import L2_EPS
from vllm_mamba.ops.triton_ssd import _softplus

_MAX_BLOCK_Q = 64  # tokens per chunk of the varlen kernel
_MAX_BLOCK_V_CHUNK = 64
_MAX_BLOCK_V_UPDATE = 32
_BLOCK_ROWS_NORM = 16
_L2_EPS = tl.constexpr(L2_EPS)


@triton.jit
def _gates(a, b, neg_exp_a_log, dt_bias, beta_scale):
    """Log decay `g = -exp(A_log) softplus(a + dt_bias)` and `beta = beta_scale sigmoid(b)`."""
    g = neg_exp_a_log * _softplus(a.to(tl.float32) + dt_bias)
    beta = beta_scale * tl.sigmoid(b.to(tl.float32))
    return g, beta


@triton.jit
def _l2_normalise(x, scale):
    """`x / sqrt(|x|^2 + eps) * scale` along the last axis of float32 `x`, as the reference."""
    return x * (tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) + _L2_EPS) * scale)


@triton.jit
def _unit_lower_inverse(A, BLOCK_Q: tl.constexpr):
    """`(I + A)^-1` of a strictly lower triangular `(Q, Q)` A, one row at a time.

    Row i is `e_i - sum_{j < i} A[i, j] T[j]`; rows not yet reached are still `e_j`, which row i
    never reads (`A[i, j] = 0` for `j >= i`).
    """
    offs = tl.arange(0, BLOCK_Q)
    rows = offs[:, None]  # (Q, 1)
    T = tl.where(rows == offs[None, :], 1.0, 0.0)  # (Q, Q)
    for i in range(1, BLOCK_Q):
        a_i = tl.sum(tl.where(rows == i, A, 0.0), axis=0)  # (Q,) row i of A
        t_i = tl.where(offs == i, 1.0, 0.0) - tl.sum(a_i[:, None] * T, axis=0)  # (Q,)
        T = tl.where(rows == i, t_i[None, :], T)
    return T


@triton.jit
def _gdn_chunked_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, states_ptr,
    qsl_ptr, idx_ptr, init_ptr, out_ptr,
    key_dim, value_dim, heads_per_key, beta_scale, q_scale,
    stride_q_t, stride_q_h, stride_q_d, stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d, stride_a_t, stride_a_h, stride_b_t, stride_b_h,
    stride_alog, stride_bias, stride_s_s, stride_s_h, stride_s_k, stride_s_v,
    stride_o_t, stride_o_h, stride_o_v,
    PAD_SLOT: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Runs the rule over tokens [start, end) of one sequence and value head, Q at a time."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(qsl_ptr + seq)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    valid = slot != PAD_SLOT
    end = tl.where(valid, tl.load(qsl_ptr + seq + 1), start)  # padding rows run no chunk
    use_init = valid & (tl.load(init_ptr + seq) != 0)
    key_head = head // heads_per_key

    offs_q = tl.arange(0, BLOCK_Q)  # (Q,)
    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    mask_k = offs_k < key_dim
    mask_v = offs_v < value_dim
    causal = offs_q[:, None] >= offs_q[None, :]  # (Q, Q) target i >= source j
    strict = offs_q[:, None] > offs_q[None, :]

    neg_exp_a_log = -tl.exp(tl.load(A_log_ptr + head * stride_alog).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head * stride_bias).to(tl.float32)

    state_ptrs = (
        states_ptr + tl.where(valid, slot, 0) * stride_s_s + head * stride_s_h
        + offs_k[:, None] * stride_s_k + offs_v[None, :] * stride_s_v
    )  # fmt: skip
    # Scalar conditions folded into row masks (the interpreter mistypes tensor & scalar).
    mask_init = tl.where(use_init, mask_k, False)[:, None] & mask_v[None, :]
    S = tl.load(state_ptrs, mask=mask_init, other=0.0).to(tl.float32)  # (BLOCK_K, BLOCK_V)

    q_cols = q_ptr + key_head * stride_q_h + offs_k[None, :] * stride_q_d  # (1, BLOCK_K)
    k_cols = k_ptr + key_head * stride_k_h + offs_k[None, :] * stride_k_d  # (1, BLOCK_K)
    v_cols = v_ptr + head * stride_v_h + offs_v[None, :] * stride_v_d  # (1, BLOCK_V)
    out_cols = out_ptr + head * stride_o_h + offs_v[None, :] * stride_o_v  # (1, BLOCK_V)
    for c0 in range(start, end, BLOCK_Q):
        offs_t = c0 + offs_q  # (Q,)
        mask_t = offs_t < end
        rows = offs_t[:, None]  # (Q, 1)
        mask_tk = mask_t[:, None] & mask_k[None, :]  # (Q, BLOCK_K)
        mask_tv = mask_t[:, None] & mask_v[None, :]  # (Q, BLOCK_V)
        q = tl.load(q_cols + rows * stride_q_t, mask=mask_tk, other=0.0).to(tl.float32)
        k = tl.load(k_cols + rows * stride_k_t, mask=mask_tk, other=0.0).to(tl.float32)
        v = tl.load(v_cols + rows * stride_v_t, mask=mask_tv, other=0.0).to(tl.float32)
        q = _l2_normalise(q, q_scale)  # (Q, BLOCK_K)
        k = _l2_normalise(k, 1.0)  # (Q, BLOCK_K)
        a = tl.load(a_ptr + offs_t * stride_a_t + head * stride_a_h, mask=mask_t, other=0.0)
        b = tl.load(b_ptr + offs_t * stride_b_t + head * stride_b_h, mask=mask_t, other=0.0)
        g, beta = _gates(a, b, neg_exp_a_log, dt_bias, beta_scale)
        g = tl.where(mask_t, g, 0.0)  # (Q,) tokens past the end leave the state alone
        beta = tl.where(mask_t, beta, 0.0)  # (Q,)
        cum = tl.cumsum(g, axis=0)  # (Q,) log decay from the chunk start
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0))  # (Q, Q)

        kk = tl.dot(k, tl.trans(k), input_precision="ieee")  # (Q, Q)
        A = tl.where(strict, beta[:, None] * kk * decay, 0.0)
        T = _unit_lower_inverse(A, BLOCK_Q)  # (Q, Q)
        k_in = k * (beta * tl.exp(cum))[:, None]  # (Q, BLOCK_K)
        W = tl.dot(T, k_in, input_precision="ieee")  # (Q, BLOCK_K)
        U = tl.dot(T, v * beta[:, None], input_precision="ieee")  # (Q, BLOCK_V)
        U -= tl.dot(W, S, input_precision="ieee")

        attn = tl.where(causal, tl.dot(q, tl.trans(k), input_precision="ieee") * decay, 0.0)
        o = tl.dot(q * tl.exp(cum)[:, None], S, input_precision="ieee")  # (Q, BLOCK_V)
        o += tl.dot(attn, U, input_precision="ieee")
        tl.store(out_cols + rows * stride_o_t, o.to(out_ptr.dtype.element_ty), mask=mask_tv)

        total = tl.sum(g, axis=0)
        k_out = k * tl.exp(total - cum)[:, None]  # (Q, BLOCK_K) decayed to the chunk's end
        S = S * tl.exp(total) + tl.dot(tl.trans(k_out), U, input_precision="ieee")

    # Empty sequences and padding rows leave their slot untouched, as the reference does.
    mask_store = tl.where(end > start, mask_k, False)[:, None] & mask_v[None, :]
    tl.store(state_ptrs, S.to(states_ptr.dtype.element_ty), mask=mask_store)


@triton.jit
def _gdn_update_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, states_ptr, idx_ptr, out_ptr,
    key_dim, value_dim, heads_per_key, beta_scale, q_scale,
    stride_q_t, stride_q_h, stride_q_d, stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d, stride_a_t, stride_a_h, stride_b_t, stride_b_h,
    stride_alog, stride_bias, stride_s_s, stride_s_h, stride_s_k, stride_s_v,
    stride_o_t, stride_o_h, stride_o_v,
    PAD_SLOT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
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

    neg_exp_a_log = -tl.exp(tl.load(A_log_ptr + head * stride_alog).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head * stride_bias).to(tl.float32)
    a = tl.load(a_ptr + row * stride_a_t + head * stride_a_h)
    b = tl.load(b_ptr + row * stride_b_t + head * stride_b_h)
    g, beta = _gates(a, b, neg_exp_a_log, dt_bias, beta_scale)

    q = tl.load(q_ptr + row * stride_q_t + key_head * stride_q_h + offs_k * stride_q_d,
                mask=mask_k, other=0.0).to(tl.float32)  # fmt: skip
    k = tl.load(k_ptr + row * stride_k_t + key_head * stride_k_h + offs_k * stride_k_d,
                mask=mask_k, other=0.0).to(tl.float32)  # fmt: skip
    v = tl.load(v_ptr + row * stride_v_t + head * stride_v_h + offs_v * stride_v_d,
                mask=mask_v, other=0.0).to(tl.float32)  # fmt: skip
    q = _l2_normalise(q, q_scale)  # (BLOCK_K,)
    k = _l2_normalise(k, 1.0)  # (BLOCK_K,)

    state_ptrs = (
        states_ptr + tl.where(valid, slot, 0) * stride_s_s + head * stride_s_h
        + offs_k[:, None] * stride_s_k + offs_v[None, :] * stride_s_v
    )  # fmt: skip
    # Scalar condition folded into the row mask (the interpreter mistypes tensor & scalar).
    mask_slot = tl.where(valid, mask_k, False)[:, None] & mask_v[None, :]
    S = tl.load(state_ptrs, mask=mask_slot, other=0.0).to(tl.float32)  # (BLOCK_K, BLOCK_V)
    S = S * tl.exp(g)
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta  # (BLOCK_V,)
    S += k[:, None] * delta[None, :]
    o = tl.where(valid, tl.sum(S * q[:, None], axis=0), 0.0)  # (BLOCK_V,) zeros for padding
    tl.store(out_ptr + row * stride_o_t + head * stride_o_h + offs_v * stride_o_v,
             o.to(out_ptr.dtype.element_ty), mask=mask_v)  # fmt: skip
    tl.store(state_ptrs, S.to(states_ptr.dtype.element_ty), mask=mask_slot)


@triton.jit
def _rms_norm_gated_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr, num_rows, dim, eps,
    stride_x_r, stride_x_d, stride_z_r, stride_z_d, stride_w, stride_o_r, stride_o_d,
    ROUND_PRODUCT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """`weight * rmsnorm(x) * silu(z)` for `BLOCK_R` rows, rounding as the reference does."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    mask = (offs_r < num_rows)[:, None] & (offs_d < dim)[None, :]  # (BLOCK_R, BLOCK_D)
    rows = offs_r[:, None]
    x = tl.load(x_ptr + rows * stride_x_r + offs_d[None, :] * stride_x_d, mask=mask, other=0.0)
    z = tl.load(z_ptr + rows * stride_z_r + offs_d[None, :] * stride_z_d, mask=mask, other=0.0)
    w = tl.load(w_ptr + offs_d * stride_w, mask=offs_d < dim, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / dim + eps)  # (BLOCK_R,)
    normed = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    scaled = w[None, :] * normed
    if ROUND_PRODUCT:  # weight and x of one dtype: torch rounds their product to it
        scaled = scaled.to(x_ptr.dtype.element_ty).to(tl.float32)
    zf = z.to(tl.float32)
    out = scaled * zf * tl.sigmoid(zf)
    out_ptrs = out_ptr + rows * stride_o_r + offs_d[None, :] * stride_o_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_args(q, k, v, a, b, A_log, dt_bias, beta_scale, ssm_states, out) -> tuple:
    """The value and stride arguments both rule kernels take, in their order."""
    key_dim = q.shape[2]
    return (
        key_dim, v.shape[2], v.shape[1] // q.shape[1], float(beta_scale), key_dim**-0.5,
        *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(),
        A_log.stride(0), dt_bias.stride(0), *ssm_states.stride(), *out.stride(),
    )  # fmt: skip


def gated_delta_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, beta_scale: float, ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `gated_delta_varlen_ref` (see there for the arguments).

    The kernel's chunk is `chunk_size` rounded to a power of two in [16, 64] (`tl.dot` needs 16
    rows, registers cap it at 64); the chunked form is exact for any chunk size.

    Returns:
        `(T, Hv, Dv)` outputs in the dtype of `v` (zeros for padding rows' tokens);
        `ssm_states` is updated in place.
    """
    num_v_heads, value_dim = v.shape[1:]
    batch = state_indices.shape[0]
    out = torch.zeros_like(v)  # (T, Hv, Dv)
    if v.shape[0] == 0 or batch == 0:
        return out
    block_q = min(_MAX_BLOCK_Q, max(16, triton.next_power_of_2(chunk_size)))
    block_v = min(_MAX_BLOCK_V_CHUNK, max(16, triton.next_power_of_2(value_dim)))
    grid = (batch, num_v_heads, triton.cdiv(value_dim, block_v))
    _gdn_chunked_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, ssm_states,
        query_start_loc, state_indices, has_initial_state, out,
        *_launch_args(q, k, v, a, b, A_log, dt_bias, beta_scale, ssm_states, out),
        PAD_SLOT=PAD_SLOT_ID, BLOCK_Q=block_q,
        BLOCK_K=max(16, triton.next_power_of_2(q.shape[2])), BLOCK_V=block_v, num_warps=8,
    )  # fmt: skip
    return out


def gated_delta_update(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, beta_scale: float, ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `gated_delta_update_ref` (see there for the arguments).

    Returns:
        `(B, Hv, Dv)` outputs in the dtype of `v` (zeros for padding rows); `ssm_states` is
        updated in place.
    """
    batch, num_v_heads, value_dim = v.shape
    out = torch.empty_like(v)  # (B, Hv, Dv)
    if batch == 0:
        return out
    block_v = min(_MAX_BLOCK_V_UPDATE, triton.next_power_of_2(value_dim))
    grid = (batch, num_v_heads, triton.cdiv(value_dim, block_v))
    _gdn_update_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, ssm_states, state_indices, out,
        *_launch_args(q, k, v, a, b, A_log, dt_bias, beta_scale, ssm_states, out),
        PAD_SLOT=PAD_SLOT_ID, BLOCK_K=triton.next_power_of_2(q.shape[2]), BLOCK_V=block_v,
    )  # fmt: skip
    return out


def rms_norm_gated(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of `rms_norm_gated_ref` (see there for the arguments).

    Returns:
        `(..., Dv)` in x's dtype.
    """
    dim = x.shape[-1]
    x2, z2 = x.reshape(-1, dim), z.reshape(-1, dim)  # (rows, Dv), views where the strides allow
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, dim)  # (rows, Dv)
    num_rows = x2.shape[0]
    if num_rows == 0:
        return out
    _rms_norm_gated_kernel[(triton.cdiv(num_rows, _BLOCK_ROWS_NORM),)](
        x2, z2, weight, out2, num_rows, dim, float(eps),
        *x2.stride(), *z2.stride(), weight.stride(0), *out2.stride(),
        ROUND_PRODUCT=torch.promote_types(weight.dtype, x.dtype) == x.dtype,
        BLOCK_R=_BLOCK_ROWS_NORM, BLOCK_D=triton.next_power_of_2(dim),
    )  # fmt: skip
    return out
