"""The Gated DeltaNet (GDN) ops: the gated delta rule over a flat varlen batch, its one-token
update, the per-head gated RMSNorm of its output, and a whole layer's decode step
(`decode_layer`: norm, input projections, conv, the rule, gated norm, out_proj, residual in one
call; its reference composes the others). Pure-PyTorch references (`*_ref`), registered as the
op family `gated_delta` (`vllm_mamba.ops.families`); a backend registers faster versions under
the same names and signatures.

Glossary (token-major layout):
    T: tokens; B: sequences (or decode rows); S: state slots; Hk: key heads; Hv: value heads
    (a multiple of Hk: value head `h` reads key head `h // (Hv / Hk)`); Dk, Dv: key and value
    head dims; Q: chunk size.
    q, k: `(T, Hk, Dk)` after the conv, before their L2 normalisation; v: `(T, Hv, Dv)`;
    a, b: `(T, Hv)` the decay and beta projections; A_log, dt_bias: `(Hv,)`.
    ssm_states: `(S, Hv, Dk, Dv)` per-slot state (float32 or bfloat16, math in float32).

Per token and value head, with q and k L2-normalised (eps 1e-6) and q scaled by `Dk ** -0.5`:

    g = -exp(A_log) * softplus(a + dt_bias)        beta = beta_scale * sigmoid(b)
    S = exp(g) S + k (beta (v - exp(g) S^T k))^T   o = S^T q

(`beta_scale` is 2 for OLMo Hybrid's `allow_neg_eigval`, else 1.) The chunked form cuts each
sequence into chunks of Q tokens from its first token. Inside a chunk, with `c` the cumulative
log decay and `S0` the state at the chunk's start, the new values `U` solve the unit lower
triangular system `(I + A) U = beta V - (beta exp(c) K) S0`, `A[i, j] = beta_i exp(c_i - c_j)
k_i . k_j` for `j < i`; then `o_i = exp(c_i) S0^T q_i + sum_{j <= i} exp(c_i - c_j)
(q_i . k_j) u_j` and the state at the chunk's end is `exp(c_Q) S0 + sum_j exp(c_Q - c_j) k_j
u_j^T`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.causal_conv1d import causal_conv1d_update_ref
from vllm_mamba.ops.families import OpFamily, OpSpec
from vllm_mamba.ops.fused_decode import _chained, _finish, _linear, _rms_norm

Tensor = torch.Tensor

FAMILY = "gated_delta"
L2_EPS = 1e-6


def gdn_gates_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    beta_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`a, b (T, Hv)` -> float32 log decay `g (T, Hv)` and `beta (T, Hv)` (see the module)."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    return g, beta * beta_scale if beta_scale != 1.0 else beta


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """L2-normalises the last dimension of float32 `x`, as FLA does (`x / sqrt(|x|^2 + eps)`)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _heads_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, ...]:
    """`q, k (..., Hk, Dk)` -> normalised float32 `(..., Hv, Dk)`, q scaled by `Dk ** -0.5`."""
    rep = num_v_heads // q.shape[-2]
    qf = _l2norm(q.float()) * q.shape[-1] ** -0.5
    kf = _l2norm(k.float())
    if rep != 1:
        qf, kf = qf.repeat_interleave(rep, dim=-2), kf.repeat_interleave(rep, dim=-2)
    return qf, kf


def _chunk_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule over one sequence (float32, prepared heads).

    Args:
        q, k: `(L, Hv, Dk)` normalised (q scaled); v: `(L, Hv, Dv)`; g, beta: `(L, Hv)`.
        state: `(Hv, Dk, Dv)` before the first token.
        chunk_size: Q.

    Returns:
        `o (L, Hv, Dv)` and the state after the last token `(Hv, Dk, Dv)`.
    """
    length = q.shape[0]
    pad = (-length) % chunk_size  # zero padding: g = 0 and beta = 0 leave the state unchanged

    def chunked(t: torch.Tensor) -> torch.Tensor:  # (L, Hv, *D) -> (Hv, n, Q, *D)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, 0, 0, pad))
        t = t.reshape(-1, chunk_size, *t.shape[1:])
        return t.movedim(2, 0)

    qc, kc, vc = chunked(q), chunked(k), chunked(v)  # (Hv, n, Q, D)
    gc, bc = chunked(g), chunked(beta)  # (Hv, n, Q)
    cum = gc.cumsum(-1)  # (Hv, n, Q)
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kk = kc @ kc.transpose(-1, -2)  # (Hv, n, Q, Q)
    system = (bc[..., None] * kk * decay).tril(-1) + torch.eye(chunk_size, device=q.device)
    rhs_v = bc[..., None] * vc  # (Hv, n, Q, Dv)
    rhs_k = (bc * cum.exp())[..., None] * kc  # (Hv, n, Q, Dk)
    u_v = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
    u_k = torch.linalg.solve_triangular(system, rhs_k, upper=False, unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * decay  # (Hv, n, Q, Q), causal
    q_start = qc * cum.exp()[..., None]  # reads the chunk's start state
    k_end = kc * (cum[..., -1:] - cum).exp()[..., None]  # writes the chunk's end state
    out = torch.empty_like(vc)
    for c in range(qc.shape[1]):
        u = u_v[:, c] - u_k[:, c] @ state  # (Hv, Q, Dv)
        out[:, c] = q_start[:, c] @ state + attn[:, c] @ u
        state = state * cum[:, c, -1].exp()[:, None, None] + k_end[:, c].transpose(-1, -2) @ u
    out = out.reshape(out.shape[0], -1, out.shape[-1])[:, :length]  # (Hv, L, Dv)
    return out.transpose(0, 1), state


def gated_delta_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    beta_scale: float,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The chunked gated delta rule over packed sequences, each from its slot's state (or zeros).

    Args:
        q, k: `(T, Hk, Dk)`; v: `(T, Hv, Dv)`; a, b: `(T, Hv)`; A_log, dt_bias: `(Hv,)`.
        beta_scale: `beta = beta_scale * sigmoid(b)`.
        ssm_states: `(S, Hv, Dk, Dv)`, read where `has_initial_state`, then overwritten with each
            sequence's final state (padding rows are skipped).
        query_start_loc: `(B + 1,)`; state_indices: `(B,)`; has_initial_state: `(B,)` bool.
        chunk_size: tokens per chunk (any length is cut at the sequence's own end).

    Returns:
        `(T, Hv, Dv)` outputs in the dtype of `v` (zeros for padding rows' tokens).
    """
    num_v_heads = v.shape[1]
    g, beta = gdn_gates_ref(a, b, A_log, dt_bias, beta_scale)
    qf, kf = _heads_qk(q, k, num_v_heads)
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
        o, final = _chunk_rule(
            qf[lo:hi], kf[lo:hi], v[lo:hi].float(), g[lo:hi], beta[lo:hi], init, chunk_size
        )
        out[lo:hi] = o
        ssm_states[slot] = final.to(ssm_states.dtype)
    return out.to(v.dtype)


def gated_delta_update_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    beta_scale: float,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """Advances each row's slot state by one token, in place (the recurrent form).

    Args:
        q, k: `(B, Hk, Dk)`; v: `(B, Hv, Dv)`; a, b: `(B, Hv)`; A_log, dt_bias: `(Hv,)`.
        beta_scale: `beta = beta_scale * sigmoid(b)`.
        ssm_states: `(S, Hv, Dk, Dv)`, updated in place for non-padding rows.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.

    Returns:
        `(B, Hv, Dv)` outputs in the dtype of `v` (zeros for padding rows).
    """
    valid = state_indices != PAD_SLOT_ID  # (B,)
    slots = state_indices.long().clamp(min=0)
    g, beta = gdn_gates_ref(a, b, A_log, dt_bias, beta_scale)  # (B, Hv)
    qf, kf = _heads_qk(q, k, v.shape[1])  # (B, Hv, Dk)
    old = ssm_states[slots].float() * torch.exp(g)[..., None, None]  # (B, Hv, Dk, Dv)
    kv_mem = torch.einsum("bhkv,bhk->bhv", old, kf)  # (B, Hv, Dv)
    delta = (v.float() - kv_mem) * beta[..., None]  # (B, Hv, Dv)
    state = old + kf[..., None] * delta[..., None, :]  # (B, Hv, Dk, Dv)
    out = torch.einsum("bhkv,bhk->bhv", state, qf) * valid[:, None, None]
    if bool(valid.any()):
        ssm_states[slots[valid]] = state[valid].to(ssm_states.dtype)
    return out.to(v.dtype)


def rms_norm_gated_ref(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`weight * rmsnorm(x) * silu(z)` over the last dimension (norm before the gate).

    Args:
        x, z: `(..., Dv)`; weight: `(Dv,)`; eps: the norm's epsilon.

    Returns:
        `(..., Dv)` in x's dtype; the statistics and the gate in float32, the normalised x cast
        to x's dtype before the weight (as transformers' `RMSNormGated`).
    """
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed) * F.silu(z.float())).to(x.dtype)


GDN_DECODE_PARAMS = (
    "norm_w", "conv_w", "A_log", "dt_bias", "gate_norm_w", "out_proj_w", "out_proj_scale",
)  # fmt: skip
# The fixed head of the `decode_layer` op's `params` by name, in the order of the C++ index
# constants (`csrc/fused_decode_gdn.cpp`: `Param`); `gdn_decode_params` appends the input
# projections.
GdnDecodeParams = NamedTuple("GdnDecodeParams", [(n, "Tensor | None") for n in GDN_DECODE_PARAMS])
MAX_INPUT_PROJECTIONS = 8  # input projections the kernel takes at most


def gdn_decode_params(
    fixed: GdnDecodeParams, in_proj: Sequence[tuple[Tensor, Tensor | None]]
) -> list[Tensor | None]:
    """The `decode_layer` op's `params`: `fixed`, then each input projection's weight and scale
    (None for a float weight), in the order of their outputs `[q | k | v | z | b | a]`."""
    if not 1 <= len(in_proj) <= MAX_INPUT_PROJECTIONS:
        raise ValueError(
            f"in_proj must hold 1 to {MAX_INPUT_PROJECTIONS} projections, got {len(in_proj)}"
        )
    return [*fixed, *(t for pair in in_proj for t in pair)]


def fused_gdn_decode_ref(
    hidden: torch.Tensor,
    params: list[torch.Tensor | None],
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    norm_eps: float,
    gate_eps: float,
    beta_scale: float,
    out_dtype: torch.dtype,
    src_state_indices: torch.Tensor | None = None,
    int_dot: bool = False,
    chain_log: torch.Tensor | None = None,
) -> torch.Tensor:
    """One GDN layer's decode step from the reference ops (the unfused mixer's ops in float32);
    states advanced in place.

    Args:
        hidden: `(B, H)` the block input (norm given) or the mixer input (norm_w None).
        params: `gdn_decode_params(...)`: norm_w `(H,)` float32 or None (the block norm's
            effective weight: `1 + w` for a zero-centred norm), conv_w `(CD, K)`, A_log and
            dt_bias `(Hv,)`, gate_norm_w `(Dv,)` (all float32), out_proj_w `(H, VD)` and its
            scale, then the input projections' weights `(rows, H)` and scales, whose outputs
            concatenated are `[q (KD) | k (KD) | v (VD) | z (VD) | b (Hv) | a (Hv)]`. A scale is
            None for a float32 / bfloat16 weight, `(rows,)` float32 for int8, `(rows, cols/32)`
            float16 for 4-bit.
        conv_states: `(S, CD, K - 1)` (CD = 2 Hk Dk + Hv Dv); ssm_states: `(S, Hv, Dk, Dv)`;
            updated in place.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped (delta rule output
            zero).
        norm_eps: the block norm's epsilon; gate_eps: the gated norm's.
        beta_scale: `beta = beta_scale * sigmoid(b)`.
        out_dtype: the result's dtype (float32 or the model dtype, as the unfused path).
        src_state_indices: `(B,)` the slot each row reads its state from (speculative chains,
            the rows in order: `ops.fused_decode._chained`).
        int_dot: the kernel's integer weights multiply int8-quantised activations; the
            reference computes the exact weight-only products either way.
        chain_log: `(S, Hv, Dk + Dv + 1)` float32, with `src_state_indices`: the chains'
            recurrent states are logged instead of written at every position
            (`_log_chains`; the conv histories are written as without it).

    Returns:
        `(B, H)`: hidden + mixer(norm(hidden)) with norm_w, else mixer(hidden).
    """
    if chain_log is not None:
        if src_state_indices is None:
            raise ValueError("chain_log needs src_state_indices (it logs speculative chains)")
        return _log_chains(
            hidden, params, conv_states, ssm_states, state_indices, src_state_indices, chain_log,
            norm_eps=norm_eps, gate_eps=gate_eps, beta_scale=beta_scale, out_dtype=out_dtype,
        )  # fmt: skip
    if src_state_indices is not None:
        return _chained(
            fused_gdn_decode_ref, hidden, (conv_states, ssm_states), state_indices,
            src_state_indices, params, conv_states, ssm_states, norm_eps=norm_eps,
            gate_eps=gate_eps, beta_scale=beta_scale, out_dtype=out_dtype, int_dot=int_dot,
        )  # fmt: skip
    fixed = len(GDN_DECODE_PARAMS)
    if len(params) <= fixed or (len(params) - fixed) % 2:
        raise ValueError(f"params must hold {fixed} entries and (weight, scale) pairs")
    p = dict(zip(GDN_DECODE_PARAMS, params[:fixed], strict=True))
    batch = hidden.shape[0]
    _, v_heads, dk, dv = ssm_states.shape
    conv_dim, value_dim = conv_states.shape[1], v_heads * dv
    key_dim = (conv_dim - value_dim) // 2
    x = hidden.float()
    xn = _rms_norm(x, p["norm_w"], norm_eps) if p["norm_w"] is not None else x
    pairs = zip(params[fixed::2], params[fixed + 1 :: 2], strict=True)
    proj = torch.cat([_linear(xn, w, None, scale) for w, scale in pairs], dim=-1)
    qkv, z, b, a = proj.split([conv_dim, value_dim, v_heads, v_heads], dim=-1)
    qkv = causal_conv1d_update_ref(qkv, conv_states, p["conv_w"], None, state_indices)
    q, k, v = qkv.split([key_dim, key_dim, value_dim], dim=-1)
    o = gated_delta_update_ref(
        q.reshape(batch, -1, dk), k.reshape(batch, -1, dk), v.reshape(batch, v_heads, dv), a, b,
        p["A_log"], p["dt_bias"], beta_scale, ssm_states, state_indices,
    )  # fmt: skip
    y = rms_norm_gated_ref(o, z.reshape(o.shape), p["gate_norm_w"], gate_eps)
    mixed = _linear(y.reshape(batch, value_dim), p["out_proj_w"], None, p["out_proj_scale"])
    return _finish(hidden, mixed, p["norm_w"] is not None, out_dtype)


def chain_rows(dst: Sequence[int], src: Sequence[int]) -> list[list[int]]:
    """The rows of each speculative chain in order: row b continues the chain of the last row
    before it whose slot `dst` is b's source slot `src[b]`; a row without one (a plain decode
    reads its own slot; a padding row none) starts a chain."""
    chains: list[list[int]] = []
    chain_of: dict[int, int] = {}
    for b, (d, s) in enumerate(zip(dst, src, strict=True)):
        chained = d != PAD_SLOT_ID and s != d  # a plain decode or a padding row: a chain of one
        prev = next((a for a in range(b - 1, -1, -1) if dst[a] == s), None) if chained else None
        chain_of[b] = len(chains) if prev is None else chain_of[prev]
        if prev is None:
            chains.append([b])
        else:
            chains[chain_of[b]].append(b)
    return chains


def _log_chains(
    hidden: Tensor,
    params: list[Tensor | None],
    conv_states: Tensor,
    ssm_states: Tensor,
    dst: Tensor,
    src: Tensor,
    chain_log: Tensor,
    *,
    norm_eps: float,
    beta_scale: float,
    **kwargs: Any,
) -> Tensor:
    """`fused_gdn_decode_ref` with a chain log: each chain of several rows writes no
    position's recurrent state. Its start state stays in its first row's source slot (the
    sequence's) and is copied to its first row's slot (the first spare), and every row leaves
    the record `[k (Dk) | delta (Dv) | decay]` per value head in the log at the row's slot,
    from which `gdn_chain_replay_ref` brings the start state to any position.

    Computed as the chained reference (every position's state written), each record then from
    the rule's own terms: the row's normalised key and gates from its projections and conv
    window, `delta = beta (v - decay S^T k)` from the state before it; then the states the
    chain wrote are put back (the start state in the source slot and the first spare, every
    other slot as before)."""
    chains = [rows for rows in chain_rows(dst.tolist(), src.tolist()) if len(rows) > 1]
    starts = {r[0]: (ssm_states[int(src[r[0]])].clone(), conv_states[int(src[r[0]])].clone())
              for r in chains}  # fmt: skip
    before = {int(dst[b]): ssm_states[int(dst[b])].clone() for rows in chains for b in rows}
    out = fused_gdn_decode_ref(
        hidden, params, conv_states, ssm_states, dst, norm_eps=norm_eps, beta_scale=beta_scale,
        src_state_indices=src, **kwargs,
    )  # fmt: skip
    fixed = len(GDN_DECODE_PARAMS)
    p = dict(zip(GDN_DECODE_PARAMS, params[:fixed], strict=True))
    x = hidden.float()
    xn = _rms_norm(x, p["norm_w"], norm_eps) if p["norm_w"] is not None else x
    pairs = zip(params[fixed::2], params[fixed + 1 :: 2], strict=True)
    proj = torch.cat([_linear(xn, w, None, scale) for w, scale in pairs], dim=-1)  # (B, NIN)
    _, v_heads, dk, dv = ssm_states.shape
    conv_dim, value_dim = conv_states.shape[1], v_heads * dv
    key_dim = (conv_dim - value_dim) // 2
    qkv, _, b_in, a_in = proj.split([conv_dim, value_dim, v_heads, v_heads], dim=-1)
    g, beta = gdn_gates_ref(a_in, b_in, p["A_log"], p["dt_bias"], beta_scale)  # (B, Hv)
    for rows in chains:
        state, hist = starts[rows[0]]
        state = state.float()  # (Hv, Dk, Dv)
        for b in rows:
            window = torch.cat([hist.float(), qkv[b, :, None]], dim=-1)  # (CD, K)
            conv = F.silu((window * p["conv_w"].float()).sum(-1))  # (CD,)
            q, k, v = conv.split([key_dim, key_dim, value_dim])
            _, kf = _heads_qk(q.reshape(-1, dk), k.reshape(-1, dk), v_heads)  # (Hv, Dk)
            decay = torch.exp(g[b])  # (Hv,)
            kv_mem = torch.einsum("hkv,hk->hv", state * decay[:, None, None], kf)
            delta = (v.reshape(v_heads, dv) - kv_mem) * beta[b, :, None]  # (Hv, Dv)
            chain_log[int(dst[b])] = torch.cat([kf, delta, decay[:, None]], dim=-1)
            state = ssm_states[int(dst[b])].float()
            hist = conv_states[int(dst[b])]
    for slot, state in before.items():  # no position's state stays written
        ssm_states[slot] = state
    for rows in chains:
        start = starts[rows[0]][0]
        ssm_states[int(src[rows[0]])] = start
        ssm_states[int(dst[rows[0]])] = start
    return out


def gdn_chain_replay_ref(
    ssm_states: Tensor, chain_log: Tensor, start: Tensor, records: Tensor, dst: Tensor
) -> None:
    """Rebuilds logged chains' states in place (`fused_gdn_decode_ref`'s `chain_log`).

    Args:
        ssm_states: `(S, Hv, Dk, Dv)`.
        chain_log: `(S, Hv, Dk + Dv + 1)` float32 records `[k | delta | decay]` by slot.
        start: `(n,)` the slot holding each chain's start state.
        records: `(n, R)` the slots of the records to apply in order, `-1` after the last.
        dst: `(n,)` where each rebuilt state goes: the start state advanced by each record,
            `S = decay S + k delta^T`, rounded to the states' dtype after each.
    """
    dk = ssm_states.shape[2]
    for i in range(start.shape[0]):
        state = ssm_states[int(start[i])]
        for r in records[i].tolist():
            if r < 0:
                break
            k, delta, decay = chain_log[r].split([dk, chain_log.shape[-1] - dk - 1, 1], dim=-1)
            new = decay[..., None] * state.float() + k[..., None] * delta[:, None, :]
            state = new.to(ssm_states.dtype)
        ssm_states[int(dst[i])] = state


class VarlenOp(Protocol):
    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
        beta_scale: float, ssm_states: Tensor, query_start_loc: Tensor, state_indices: Tensor,
        has_initial_state: Tensor, chunk_size: int = 64,
    ) -> Tensor: ...  # fmt: skip


class UpdateOp(Protocol):
    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
        beta_scale: float, ssm_states: Tensor, state_indices: Tensor,
    ) -> Tensor: ...  # fmt: skip


class NormGateOp(Protocol):
    def __call__(self, x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor: ...


class DecodeLayerOp(Protocol):
    def __call__(
        self, hidden: Tensor, params: list[Tensor | None], conv_states: Tensor,
        ssm_states: Tensor, state_indices: Tensor, norm_eps: float, gate_eps: float,
        beta_scale: float, out_dtype: torch.dtype, src_state_indices: Tensor | None = None,
        int_dot: bool = False, chain_log: Tensor | None = None,
    ) -> Tensor: ...  # fmt: skip


class ChainReplayOp(Protocol):
    def __call__(
        self, ssm_states: Tensor, chain_log: Tensor, start: Tensor, records: Tensor, dst: Tensor
    ) -> None: ...


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    FAMILY,
    {
        "varlen": OpSpec(VarlenOp, gated_delta_varlen_ref),
        "update": OpSpec(UpdateOp, gated_delta_update_ref),
        "norm_gate": OpSpec(NormGateOp, rms_norm_gated_ref),
        # one GDN layer's decode step (C++: `csrc/fused_decode_gdn.cpp`); a backend without it
        # runs the layer unfused (the mixers ask `own_op`, never this reference)
        "decode_layer": OpSpec(DecodeLayerOp, fused_gdn_decode_ref),
        # rebuilds the states of chains `decode_layer` logged (C++: `fused_decode_gdn.cpp`)
        "chain_replay": OpSpec(ChainReplayOp, gdn_chain_replay_ref),
    },
)
