"""The Kimi Delta Attention (KDA) ops: the gated delta rule with a decay per key channel, over a
flat varlen batch, its one-token update, the sigmoid-gated RMSNorm of its output, and a whole
layer's decode step (`decode_layer`: norm, projections, convs, gates, the rule, gated norm,
o_proj, residual in one call; its reference composes the others).
Pure-PyTorch references (`*_ref`), registered as the op family `kda`
(`vllm_mamba.ops.families`); a backend registers faster versions under the same names and
signatures (`cpp`: `csrc/kda.cpp`, `triton`: `vllm_mamba.ops.triton_kda`).

KDA is Kimi Linear's linear-attention mixer (transformers' `KimiLinearDeltaAttention`): Gated
DeltaNet (`vllm_mamba.ops.gated_delta`) whose log decay `g` is a `(Dk,)` vector per head and
token instead of a scalar, so the state decays row by row, `S = diag(exp(g)) S`. Ling-3.0
(`BailingHybrid`) and GLM-5-Next run the same rule with transformers' bounded "safe gate"
(`kda_safe_gate`, `kda_lower_bound`) in place of Kimi's softplus gate: every op that computes
`g` takes `lower_bound`, 0 (the default) for Kimi's gate, negative for the safe gate.

Glossary (token-major layout):
    T: tokens; B: sequences (or decode rows); S: state slots; Hk: key heads; Hv: value heads
    (a multiple of Hk: value head `h` reads key head `h // (Hv / Hk)`; Kimi has Hk == Hv);
    Dk, Dv: key and value head dims; Q: chunk size.
    q, k: `(T, Hk, Dk)` after the conv, before their L2 normalisation; v: `(T, Hv, Dv)`;
    a: `(T, Hv * Dk)` the forget gate's input (Kimi's low-rank `f_b_proj(f_a_proj(x))`, Ling's
    full-rank `f_proj(x)`);
    b: `(T, Hv)` the beta projection; A_log: `(Hv,)` (the checkpoint's `(1, 1, Hv, 1)`
    flattened); dt_bias: `(Hv * Dk,)`.
    ssm_states: `(S, Hv, Dk, Dv)` per-slot state (float32 or bfloat16, math in float32).

Per token and value head h, with q and k L2-normalised in float32 (`x / sqrt(|x|^2 + 1e-6)`)
and q scaled by `Dk ** -0.5`:

    g = -exp(A_log[h]) * softplus(a[h] + dt_bias[h])      (Dk,), softplus = x above 20
        (lower_bound == 0: Kimi's gate), or
    g = lower_bound * sigmoid(exp(A_log[h]) * (a[h] + dt_bias[h]))
        (lower_bound < 0: the safe gate, `lower_bound <= g <= 0`)
    beta = sigmoid(b[h])                                  scalar
    S = diag(exp(g)) S ;  S += k (beta (v - S^T k))^T ;  o = S^T q

The chunked form cuts each sequence into chunks of Q tokens from its first token. Inside a
chunk, with `c_i = g_1 + ... + g_i` the per-channel cumulative log decay (`(Dk,)`, `<= 0`,
relative to the chunk's start) and `S0` the state at the chunk's start, the new values `U`
solve the unit lower triangular system

    (I + A) U = beta V - (beta k_i * exp(c_i)) S0,  A[i, j] = beta_i sum_d k_i[d] k_j[d]
                                                              exp(c_i[d] - c_j[d]),  j < i

then `o_i = (q_i * exp(c_i)) S0 + sum_{j <= i} (sum_d q_i[d] k_j[d] exp(c_i[d] - c_j[d])) u_j`
and the chunk's end state is `diag(exp(c_Q)) S0 + sum_j (k_j * exp(c_Q - c_j)) u_j^T`. Every
exponent above is `<= 0` (a decay over tokens that have happened), so no exp overflows however
strong the decay; the references and kernels compute the pairwise factors `exp(c_i - c_j)`
directly rather than as `exp(c_i) * exp(-c_j)`, which would overflow, and without cancellation
in `c_i - c_j` (the reference sums in float64, the C++ kernel multiplies the tokens' decays).

The output norm (`KimiLinearRMSNormGated`): `o_norm(o, gate) = weight * rmsnorm(o) *
sigmoid(gate)` per head of Dv, in float32 (the weight in float32 too), cast back to o's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.causal_conv1d import causal_conv1d_update_ref
from vllm_mamba.ops.families import OpFamily, OpSpec
from vllm_mamba.ops.fused_decode import _chained, _finish, _linear, _rms_norm
from vllm_mamba.ops.gated_delta import L2_EPS, _heads_qk

Tensor = torch.Tensor

__all__ = [
    "FAMILY",
    "CHUNK_SIZE",
    "check_lower_bound",
    "kda_gates_ref",
    "kda_varlen_ref",
    "kda_varlen_recurrent_ref",
    "kda_update_ref",
    "kda_norm_gate_ref",
    "KDA_DECODE_PARAMS",
    "KdaDecodeParams",
    "fused_kda_decode_ref",
]

FAMILY = "kda"
# The C++ kernel's chunk, by measurement (`csrc/kda.cpp`, float32, avx512, one thread, best of
# 25, a shared machine so about 10% noise), ms per call on one sequence:
#   T=512, H=4, D=128:  Q=8 1.9-3.1, Q=12 2.0-2.7, Q=16 2.1-2.8, Q=32 3.1, Q=64 5.0-5.8
#   T=512, H=4, D=64:   Q=8 0.75-0.99, Q=12 0.79-0.83, Q=16 0.94-1.0
#   T=2048, H=2, D=128: Q=8 5.4-6.0, Q=12 4.7-5.3, Q=16 5.6-5.9
# (gated_delta's kernel at T=512, H=4, D=128: 3.6-4.1 ms). The pairwise decay factors grow with
# Q per token, the chunk's pass over the state shrinks with it; 8 and 12 trade places, 12 is
# never far from the best and fills the kernel's 6-row tiles.
CHUNK_SIZE = 12
SOFTPLUS_THRESHOLD = 20.0  # softplus(x) = x above it, as transformers' forget gate
assert L2_EPS == 1e-6

# A rule over one sequence: (q, k, v, g, beta, state) -> (o, final state), float32.
Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def check_lower_bound(lower_bound: float) -> float:
    """`lower_bound` as a float, checked: 0 (Kimi's softplus gate) or negative (the safe gate).

    Raises:
        ValueError: a positive (or NaN) lower bound.
    """
    lower_bound = float(lower_bound)
    if not lower_bound <= 0.0:
        raise ValueError(f"lower_bound must be 0 (softplus gate) or negative, got {lower_bound}")
    return lower_bound


def kda_gates_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel log decay and beta of each token and value head.

    With `x = a + dt_bias` in float32, `g = -exp(A_log) * softplus(x)` (softplus = x above 20;
    Kimi's gate) where `lower_bound == 0`, else `g = lower_bound * sigmoid(exp(A_log) * x)`
    (transformers' safe gate, `kda_lower_bound`), all in float32.

    Args:
        a: `(T, Hv * Dk)` (or `(T, Hv, Dk)`); b: `(T, Hv)`; A_log: `(Hv,)` (any shape of Hv
            elements); dt_bias: `(Hv * Dk,)`.
        lower_bound: 0 for the softplus gate, negative for the safe gate (`g >= lower_bound`).

    Returns:
        float32 `g (T, Hv, Dk)` (`<= 0`) and `beta (T, Hv)`.

    Raises:
        ValueError: a positive `lower_bound`.
    """
    lower_bound = check_lower_bound(lower_bound)
    tokens, num_v_heads = b.shape
    width = dt_bias.numel()  # Hv * Dk
    x = (a.float().reshape(tokens, width) + dt_bias.float().reshape(width)).view(
        tokens, num_v_heads, width // num_v_heads
    )  # (T, Hv, Dk)
    rate = torch.exp(A_log.float().reshape(num_v_heads, 1))  # (Hv, 1)
    if lower_bound < 0.0:
        g = lower_bound * torch.sigmoid(rate * x)
    else:
        g = -rate * torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x)))
    return g, torch.sigmoid(b.float())


def _recurrent_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token over one sequence (float32, prepared heads).

    Args:
        q, k: `(L, Hv, Dk)` normalised (q scaled); v: `(L, Hv, Dv)`; g: `(L, Hv, Dk)`;
        beta: `(L, Hv)`; state: `(Hv, Dk, Dv)` before the first token.

    Returns:
        `o (L, Hv, Dv)` and the state after the last token `(Hv, Dk, Dv)`.
    """
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * torch.exp(g[t])[..., None]  # (Hv, Dk, Dv)
        kv_mem = torch.einsum("hkv,hk->hv", state, k[t])  # (Hv, Dv)
        delta = (v[t] - kv_mem) * beta[t, :, None]  # (Hv, Dv)
        state = state + k[t, :, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out, state


def _chunk_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule (the module's WY form) over one sequence (float32, prepared heads).

    Args:
        q, k: `(L, Hv, Dk)` normalised (q scaled); v: `(L, Hv, Dv)`; g: `(L, Hv, Dk)`;
        beta: `(L, Hv)`; state: `(Hv, Dk, Dv)` before the first token; chunk_size: Q.

    Returns:
        `o (L, Hv, Dv)` and the state after the last token `(Hv, Dk, Dv)`.
    """
    length = q.shape[0]
    pad = (-length) % chunk_size  # zero padding: g = 0 and beta = 0 leave the state unchanged

    def chunked(t: torch.Tensor) -> torch.Tensor:  # (L, Hv, *D) -> (Hv, n, Q, *D)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, 0, 0, pad))
        t = t.reshape(-1, chunk_size, *t.shape[1:])
        return t.movedim(2, 0)

    qc, kc, vc, gc = chunked(q), chunked(k), chunked(v), chunked(g)  # (Hv, n, Q, D)
    bc = chunked(beta)  # (Hv, n, Q)
    # The cumulative sums in float64: c_i - c_j of float32 sums loses |c_j| * 2^-24 to
    # cancellation, which matters where strong decays precede weak ones.
    cum = gc.double().cumsum(-2)  # (Hv, n, Q, Dk), <= 0
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    diff = cum[..., :, None, :] - cum[..., None, :, :]  # (Hv, n, Q, Q, Dk): c_i - c_j
    decay = diff.masked_fill(~lower[..., None], float("-inf")).exp().float()  # 0 above
    end_decay = (cum[..., -1:, :] - cum).exp().float()  # (Hv, n, Q, Dk): exp(c_Q - c_j)
    cum_decay = cum.exp().float()  # (Hv, n, Q, Dk): exp(c_i)
    kk = torch.einsum("hnid,hnjd,hnijd->hnij", kc, kc, decay)  # (Hv, n, Q, Q)
    qk = torch.einsum("hnid,hnjd,hnijd->hnij", qc, kc, decay)  # (Hv, n, Q, Q), causal
    eye = torch.eye(chunk_size, device=q.device)
    system = (bc[..., None] * kk).tril(-1) + eye
    rhs_v = bc[..., None] * vc  # (Hv, n, Q, Dv)
    rhs_k = bc[..., None] * kc * cum_decay  # (Hv, n, Q, Dk)
    u_v = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
    u_k = torch.linalg.solve_triangular(system, rhs_k, upper=False, unitriangular=True)
    q_start = qc * cum_decay  # reads the chunk's start state
    k_end = kc * end_decay  # writes the chunk's end state
    out = torch.empty_like(vc)
    for c in range(qc.shape[1]):
        u = u_v[:, c] - u_k[:, c] @ state  # (Hv, Q, Dv)
        out[:, c] = q_start[:, c] @ state + qk[:, c] @ u
        state = state * cum_decay[:, c, -1, :, None] + k_end[:, c].transpose(-1, -2) @ u
    out = out.reshape(out.shape[0], -1, out.shape[-1])[:, :length]  # (Hv, L, Dv)
    return out.transpose(0, 1), state


def _varlen(
    rule: Rule,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    lower_bound: float,
) -> torch.Tensor:
    """Runs `rule` over each packed sequence from its slot's state (or zeros); see
    `kda_varlen_ref`."""
    num_v_heads = v.shape[1]
    g, beta = kda_gates_ref(a, b, A_log, dt_bias, lower_bound)  # (T, Hv, Dk), (T, Hv)
    qf, kf = _heads_qk(q, k, num_v_heads)  # (T, Hv, Dk)
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    starts = query_start_loc.tolist()
    for i, slot in enumerate(state_indices.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if slot == PAD_SLOT_ID or hi == lo:
            continue
        if bool(has_initial_state[i]):
            init = ssm_states[slot].float()
        else:
            init = torch.zeros(ssm_states.shape[1:], dtype=torch.float32, device=v.device)
        o, final = rule(qf[lo:hi], kf[lo:hi], v[lo:hi].float(), g[lo:hi], beta[lo:hi], init)
        out[lo:hi] = o
        ssm_states[slot] = final.to(ssm_states.dtype)
    return out.to(q.dtype)


def kda_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
    lower_bound: float = 0.0,
) -> torch.Tensor:
    """The chunked KDA rule over packed sequences, each from its slot's state (or zeros).

    Args:
        q, k: `(T, Hk, Dk)`; v: `(T, Hv, Dv)`; a: `(T, Hv * Dk)`; b: `(T, Hv)`;
            A_log: `(Hv,)`; dt_bias: `(Hv * Dk,)`.
        ssm_states: `(S, Hv, Dk, Dv)`, read where `has_initial_state`, then overwritten with each
            sequence's final state (padding rows and empty sequences are skipped).
        query_start_loc: `(B + 1,)` int32; state_indices: `(B,)` int32 slots, `PAD_SLOT_ID`
            rows skipped; has_initial_state: `(B,)` bool.
        chunk_size: tokens per chunk (any length is cut at the sequence's own end); the result
            equals `kda_varlen_recurrent_ref`'s for every chunk size, up to rounding.
        lower_bound: the gate (`kda_gates_ref`): 0 for Kimi's softplus gate, negative for the
            safe gate `g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))`.

    Returns:
        `(T, Hv, Dv)` outputs in q's dtype (zeros for padding rows' tokens).
    """
    return _varlen(
        lambda *x: _chunk_rule(*x, chunk_size),
        q, k, v, a, b, A_log, dt_bias, ssm_states, query_start_loc, state_indices,
        has_initial_state, lower_bound,
    )  # fmt: skip


def kda_varlen_recurrent_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
    lower_bound: float = 0.0,
) -> torch.Tensor:
    """`kda_varlen_ref` computed token by token (the recurrent form; `chunk_size` is unused).

    Returns:
        `(T, Hv, Dv)` outputs in q's dtype; `ssm_states` updated as `kda_varlen_ref` does.
    """
    del chunk_size
    return _varlen(
        _recurrent_rule,
        q, k, v, a, b, A_log, dt_bias, ssm_states, query_start_loc, state_indices,
        has_initial_state, lower_bound,
    )  # fmt: skip


def kda_update_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    lower_bound: float = 0.0,
) -> torch.Tensor:
    """Advances each row's slot state by one token, in place (the recurrent form).

    Args:
        q, k: `(B, Hk, Dk)`; v: `(B, Hv, Dv)`; a: `(B, Hv * Dk)`; b: `(B, Hv)`;
            A_log: `(Hv,)`; dt_bias: `(Hv * Dk,)`.
        ssm_states: `(S, Hv, Dk, Dv)`, updated in place for non-padding rows.
        state_indices: `(B,)` int32 slot per row, `PAD_SLOT_ID` rows are skipped.
        lower_bound: the gate (`kda_gates_ref`): 0 for Kimi's softplus gate, negative for the
            safe gate.

    Returns:
        `(B, Hv, Dv)` outputs in q's dtype (zeros for padding rows).
    """
    valid = state_indices != PAD_SLOT_ID  # (B,)
    slots = state_indices.long().clamp(min=0)
    g, beta = kda_gates_ref(a, b, A_log, dt_bias, lower_bound)  # (B, Hv, Dk), (B, Hv)
    qf, kf = _heads_qk(q, k, v.shape[1])  # (B, Hv, Dk)
    old = ssm_states[slots].float() * torch.exp(g)[..., None]  # (B, Hv, Dk, Dv)
    kv_mem = torch.einsum("bhkv,bhk->bhv", old, kf)  # (B, Hv, Dv)
    delta = (v.float() - kv_mem) * beta[..., None]  # (B, Hv, Dv)
    state = old + kf[..., None] * delta[..., None, :]  # (B, Hv, Dk, Dv)
    out = torch.einsum("bhkv,bhk->bhv", state, qf) * valid[:, None, None]
    if bool(valid.any()):
        ssm_states[slots[valid]] = state[valid].to(ssm_states.dtype)
    return out.to(q.dtype)


def kda_norm_gate_ref(
    o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`weight * rmsnorm(o) * sigmoid(gate)` over the last dimension (transformers'
    `KimiLinearRMSNormGated`).

    Args:
        o, gate: `(..., Dv)` (e.g. `(T, Hv, Dv)`); weight: `(Dv,)`; eps: the norm's epsilon.

    Returns:
        `(..., Dv)` in o's dtype; everything in float32 (the weight too), rounded once.
    """
    of = o.float()
    normed = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed * torch.sigmoid(gate.float())).to(o.dtype)


KDA_DECODE_PARAMS = (
    "norm_w", "conv_w", "A_log", "dt_bias", "gate_norm_w", "out_proj_w", "out_proj_scale",
    "f_b_w", "f_b_scale", "g_b_w", "g_b_scale",
)  # fmt: skip
# The fixed head of the `decode_layer` op's `params` by name, in the order of the C++ index
# constants (`csrc/fused_decode_kda.cpp`: `Param`); `gated_delta.gdn_decode_params` appends the
# input projections (`[q | k | v | f_a | g_a | b]`, or `[q | k | v | a | gate | b]` for
# single-stage gates: f_b_w, g_b_w and their scales None).
KdaDecodeParams = NamedTuple("KdaDecodeParams", [(n, "Tensor | None") for n in KDA_DECODE_PARAMS])


def fused_kda_decode_ref(
    hidden: torch.Tensor,
    params: list[torch.Tensor | None],
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    norm_eps: float,
    gate_eps: float,
    out_dtype: torch.dtype,
    src_state_indices: torch.Tensor | None = None,
    int_dot: bool = False,
    lower_bound: float = 0.0,
) -> torch.Tensor:
    """One KDA layer's decode step from the reference ops (the unfused mixer's ops in float32);
    states advanced in place.

    Args:
        hidden: `(B, H)` the block input (norm given) or the mixer input (norm_w None).
        params: `KdaDecodeParams` then each input projection's (weight, scale)
            (`gated_delta.gdn_decode_params`): norm_w `(H,)` float32 or None (the block norm's
            effective weight), conv_w `(CD, K)`, A_log `(Hv,)`, dt_bias `(Hv Dk,)`,
            gate_norm_w `(Dv,)` (all float32), out_proj_w `(H, VD)`, f_b_w `(Hv Dk, R)`,
            g_b_w `(VD, R)` with their scales, then the input projections' weights `(rows, H)`
            and scales, whose outputs concatenated are
            `[q (KD) | k (KD) | v (VD) | f_a (R) | g_a (R) | b (Hv)]`. Single-stage gates
            (Ling's full-rank `f_proj`, `g_proj`): f_b_w, g_b_w and their scales None, and the
            outputs are `[q | k | v | a (Hv Dk) | gate (VD) | b]`. A scale is None for a
            float32 / bfloat16 weight, `(rows,)` float32 for int8, `(rows, cols/32)` float16
            for 4-bit.
        conv_states: `(S, CD, K - 1)` (CD = 2 Hk Dk + Hv Dv); ssm_states: `(S, Hv, Dk, Dv)`;
            updated in place.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped (rule output zero).
        norm_eps: the block norm's epsilon; gate_eps: the output norm's.
        out_dtype: the result's dtype (float32 or the model dtype, as the unfused path).
        src_state_indices: `(B,)` the slot each row reads its state from (speculative chains,
            the rows in order: `ops.fused_decode._chained`).
        int_dot: the integer weights multiply int8-quantised activations (as the unfused
            layer's `w8a8_linear` / `w4a8_linear` do); float weights ignore it.
        lower_bound: the forget gate (`kda_gates_ref`): 0 for Kimi's softplus gate, negative
            for the safe gate.

    Returns:
        `(B, H)`: hidden + mixer(norm(hidden)) with norm_w, else mixer(hidden).

    Raises:
        ValueError: a malformed params list (one of f_b_w, g_b_w given without the other) or a
            positive `lower_bound`.
    """
    check_lower_bound(lower_bound)
    if src_state_indices is not None:
        return _chained(
            fused_kda_decode_ref, hidden, (conv_states, ssm_states), state_indices,
            src_state_indices, params, conv_states, ssm_states, norm_eps=norm_eps,
            gate_eps=gate_eps, out_dtype=out_dtype, int_dot=int_dot, lower_bound=lower_bound,
        )  # fmt: skip
    fixed = len(KDA_DECODE_PARAMS)
    if len(params) <= fixed or (len(params) - fixed) % 2:
        raise ValueError(f"params must hold {fixed} entries and (weight, scale) pairs")
    p = KdaDecodeParams(*params[:fixed])
    two_stage = p.f_b_w is not None
    if (p.g_b_w is not None) != two_stage:
        raise ValueError("f_b_w and g_b_w must both be given (two-stage gates) or both be None")
    batch = hidden.shape[0]
    _, v_heads, dk, dv = ssm_states.shape
    conv_dim, value_dim = conv_states.shape[1], v_heads * dv
    key_dim = (conv_dim - value_dim) // 2
    x = hidden.float()
    xn = _rms_norm(x, p.norm_w, norm_eps) if p.norm_w is not None else x
    pairs = zip(params[fixed::2], params[fixed + 1 :: 2], strict=True)
    proj = torch.cat([_linear(xn, w, None, scale, int_dot) for w, scale in pairs], dim=-1)
    if two_stage:
        rank = (proj.shape[-1] - conv_dim - v_heads) // 2
        widths = [rank, rank]
    else:
        widths = [v_heads * dk, value_dim]
    qkv, f, g, b = proj.split([conv_dim, *widths, v_heads], dim=-1)
    qkv = causal_conv1d_update_ref(qkv, conv_states, p.conv_w, None, state_indices)
    q, k, v = qkv.split([key_dim, key_dim, value_dim], dim=-1)
    if two_stage:  # the low-rank gates' second stages
        a = _linear(f, p.f_b_w, None, p.f_b_scale, int_dot)  # (B, Hv Dk)
        gate = _linear(g, p.g_b_w, None, p.g_b_scale, int_dot)  # (B, VD)
    else:
        a, gate = f, g
    o = kda_update_ref(
        q.reshape(batch, -1, dk), k.reshape(batch, -1, dk), v.reshape(batch, v_heads, dv), a, b,
        p.A_log, p.dt_bias, ssm_states, state_indices, lower_bound,
    )  # fmt: skip
    y = kda_norm_gate_ref(o, gate.reshape(o.shape), p.gate_norm_w, gate_eps)
    mixed = _linear(y.reshape(batch, value_dim), p.out_proj_w, None, p.out_proj_scale, int_dot)
    return _finish(hidden, mixed, p.norm_w is not None, out_dtype)


class VarlenOp(Protocol):
    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
        ssm_states: Tensor, query_start_loc: Tensor, state_indices: Tensor,
        has_initial_state: Tensor, chunk_size: int = CHUNK_SIZE, lower_bound: float = 0.0,
    ) -> Tensor: ...  # fmt: skip


class UpdateOp(Protocol):
    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
        ssm_states: Tensor, state_indices: Tensor, lower_bound: float = 0.0,
    ) -> Tensor: ...  # fmt: skip


class NormGateOp(Protocol):
    def __call__(self, o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor: ...


class DecodeLayerOp(Protocol):
    def __call__(
        self, hidden: Tensor, params: list[Tensor | None], conv_states: Tensor,
        ssm_states: Tensor, state_indices: Tensor, norm_eps: float, gate_eps: float,
        out_dtype: torch.dtype, src_state_indices: Tensor | None = None, int_dot: bool = False,
        lower_bound: float = 0.0,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    FAMILY,
    {
        "varlen": OpSpec(VarlenOp, kda_varlen_ref),
        "update": OpSpec(UpdateOp, kda_update_ref),
        "norm_gate": OpSpec(NormGateOp, kda_norm_gate_ref),
        # one KDA layer's decode step (C++: `csrc/fused_decode_kda.cpp`); a backend without it
        # runs the layer unfused (the mixer asks `own_op`, never this reference)
        "decode_layer": OpSpec(DecodeLayerOp, fused_kda_decode_ref),
    },
)
