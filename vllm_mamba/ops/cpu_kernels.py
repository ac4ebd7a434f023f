"""The C++ CPU backend of the Mamba ops: thin wrappers over `torch.ops.vllm_mamba.*`.

The kernels live in `csrc/` and are built, once per ISA level, into the extensions
`vllm_mamba._C_<level>` by `pip install --no-build-isolation -e .`; `cpu_isa.load()` imports
the one this CPU runs, which registers the ops. Every wrapper has the
signature of its `_ref` twin (`vllm_mamba.ops.causal_conv1d`, `vllm_mamba.ops.selective_scan`,
`vllm_mamba.ops.ssd`, `vllm_mamba.ops.gated_delta`, `vllm_mamba.ops.kda`,
`vllm_mamba.ops.mla_attention`, `vllm_mamba.ops.short_conv`, `vllm_mamba.ops.rwkv7`,
`vllm_mamba.ops.rwkv4`), so `vllm_mamba.ops.dispatch` can swap them in; the Gated DeltaNet,
Kimi Delta Attention, latent-cache attention, short conv and RWKV ones are registered as the
`cpp` backend's `gated_delta`, `kda`, `mla`, `short_conv`, `rwkv7` and `rwkv4` families. The
kernels copy non-contiguous activations to contiguous ones themselves; the states are updated
in place and must be contiguous.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from vllm_mamba import envs
from vllm_mamba.ops import (
    cpu_isa,
    gated_delta,  # registers the `gated_delta` family first
    kda,  # registers the `kda` family first
    mla_attention,  # registers the `mla` family first
    rwkv4,  # the `rwkv4` family
    rwkv7,  # the `rwkv7` family
    short_conv,  # and the `short_conv` family
)
from vllm_mamba.ops.families import register_op_impl
from vllm_mamba.ops.int4_linear import has_int4_kernel, int4_linear_cpp, int4_linear_ref
from vllm_mamba.ops.int8_linear import has_int8_kernel, int8_linear_cpp, int8_linear_ref
from vllm_mamba.ops.table import MambaOps

try:
    _EXTENSION_LOADED = cpu_isa.load() is not None  # registers torch.ops.vllm_mamba.*
except OSError:
    _EXTENSION_LOADED = False

_OP_NAMES = (
    "causal_conv1d_varlen",
    "causal_conv1d_update",
    "selective_scan_varlen",
    "selective_state_update",
    "linear_small_batch",
    "bf16_linear",
    "ssd_chunk_scan_varlen",
    "ssd_state_update",
    "gated_rms_norm",
    "reshape_and_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "gated_delta_varlen",
    "gated_delta_update",
    "rms_norm_gated",
    "kda_varlen",
    "kda_update",
    "kda_norm_gate",
    "mla_cache_write",
    "mla_decode_attention",
    "mla_prefill_attention",
    "short_conv_update",
    "short_conv_varlen",
    "rwkv7_varlen",
    "rwkv7_update",
    "rwkv7_shift_mix",
    "rwkv7_fused_update",
    "fused_rwkv7_decode",
    "rwkv4_varlen",
    "rwkv4_update",
)
SMALL_BATCH = 8  # rows up to which `linear` streams the weight with the matrix-vector kernel


def available() -> bool:
    """Whether the extension is built and registers every op.

    Returns:
        True when a kernel build (`cpu_isa`) imports and `torch.ops.vllm_mamba` has every op.
    """
    return _EXTENSION_LOADED and all(hasattr(torch.ops.vllm_mamba, name) for name in _OP_NAMES)


@functools.cache
def native_bf16() -> bool:
    """Whether the loaded kernel build multiplies bfloat16 natively (AVX512-BF16 or AMX, in the
    avx512 build only): then bfloat16 GEMMs run as bfloat16, else widened to float32."""
    return _EXTENSION_LOADED and bool(torch.ops.vllm_mamba.native_bf16())


def flush_denormals() -> None:
    """Flushes denormal floats to zero on this thread and on every thread of torch's intra-op
    pool (`csrc/denormals.cpp`); without the extension, on this thread and later threads."""
    torch.set_flush_denormal(True)
    if _EXTENSION_LOADED and hasattr(torch.ops.vllm_mamba, "set_flush_denormal_all_threads"):
        torch.ops.vllm_mamba.set_flush_denormal_all_threads(True)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: bool = True,
) -> torch.Tensor:
    """Causal conv1d over packed sequences; see `causal_conv1d_varlen_ref`.

    Args:
        x: `(T, D)` inputs, float32 or bfloat16.
        weight: `(D, K)` depthwise filters.
        bias: `(D,)` or None.
        conv_states: `(S, D, K - 1)`, contiguous, float32 or bfloat16; updated in place.
        query_start_loc: `(B + 1,)` int, cumulative sequence starts.
        state_indices: `(B,)` int slot per sequence, `PAD_SLOT_ID` for padding.
        has_initial_state: `(B,)` bool.
        activation: apply SiLU to the output.

    Returns:
        `(T, D)` outputs in the dtype of `x`.
    """
    return torch.ops.vllm_mamba.causal_conv1d_varlen(
        x, weight, bias, conv_states, query_start_loc, state_indices, has_initial_state,
        activation,
    )  # fmt: skip


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: bool = True,
) -> torch.Tensor:
    """One decode step of the causal conv1d; see `causal_conv1d_update_ref`.

    Args:
        x: `(B, D)` the new input of each sequence.
        conv_states: `(S, D, K - 1)`, contiguous; updated in place for non-padding rows.
        weight: `(D, K)`; bias: `(D,)` or None.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.
        activation: apply SiLU to the output.

    Returns:
        `(B, D)` outputs in the dtype of `x` (padding rows use a zero history).
    """
    return torch.ops.vllm_mamba.causal_conv1d_update(
        x, conv_states, weight, bias, state_indices, activation
    )


def selective_scan_varlen(
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B_: torch.Tensor,
    C: torch.Tensor,
    D_skip: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """Selective scan over packed sequences; see `selective_scan_varlen_ref`.

    Args:
        u, dt, z: `(T, D)`; A: `(D, N)`; B_, C: `(T, N)`; D_skip, dt_bias: `(D,)` or None.
        dt_softplus: apply softplus to `dt + dt_bias`.
        ssm_states: `(S, D, N)`, contiguous, float32 or bfloat16; updated in place.
        query_start_loc: `(B + 1,)`; state_indices: `(B,)`; has_initial_state: `(B,)` bool.

    Returns:
        `(T, D)` outputs in the dtype of `u`.
    """
    return torch.ops.vllm_mamba.selective_scan_varlen(
        u, dt, A, B_, C, D_skip, z, dt_bias, dt_softplus, ssm_states, query_start_loc,
        state_indices, has_initial_state,
    )  # fmt: skip


def selective_state_update(
    ssm_states: torch.Tensor,
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B_: torch.Tensor,
    C: torch.Tensor,
    D_skip: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One decode step of the selective scan; see `selective_state_update_ref`.

    Args:
        ssm_states: `(S, D, N)`, contiguous; updated in place for non-padding rows.
        u, dt, z: `(B, D)`; A: `(D, N)`; B_, C: `(B, N)`; D_skip, dt_bias: `(D,)` or None.
        dt_softplus: apply softplus to `dt + dt_bias`.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.

    Returns:
        `(B, D)` outputs in the dtype of `u` (padding rows start from a zero state).
    """
    return torch.ops.vllm_mamba.selective_state_update(
        ssm_states, u, dt, A, B_, C, D_skip, z, dt_bias, dt_softplus, state_indices
    )


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
    """Mamba2's SSD scan over packed sequences; see `ssd_chunk_scan_varlen_ref`.

    The kernel runs the recurrence token by token (exact for any `chunk_size`, which it only
    checks), in parallel over sequences, heads and blocks of head-dim rows.

    Args:
        x: `(T, H, P)`; dt: `(T, H)`; A: `(H,)`; B_, C: `(T, G, N)`;
            D_skip, dt_bias: `(H,)` or None. Views with a free token stride are read in place.
        dt_softplus: apply softplus to `dt + dt_bias`; the result is clamped to `dt_limit`.
        ssm_states: `(S, H, P, N)`, contiguous, float32 or bfloat16; updated in place.
        query_start_loc: `(B + 1,)`; state_indices: `(B,)`; has_initial_state: `(B,)` bool.
        chunk_size: the model's SSD chunk size.

    Returns:
        `(T, H, P)` outputs in the dtype of `x`.
    """
    return torch.ops.vllm_mamba.ssd_chunk_scan_varlen(
        x, dt, A, B_, C, D_skip, dt_bias, dt_softplus, float(dt_limit[0]), float(dt_limit[1]),
        ssm_states, query_start_loc, state_indices, has_initial_state, chunk_size,
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
    """One decode step of Mamba2's SSD, per head, in place; see `ssd_state_update_ref`.

    Args:
        ssm_states: `(S, H, P, N)`, contiguous; updated in place for non-padding rows.
        x: `(B, H, P)`; dt: `(B, H)`; A: `(H,)`; B_, C: `(B, G, N)`;
            D_skip, dt_bias: `(H,)` or None.
        dt_softplus: apply softplus to `dt + dt_bias` (not clamped, like the reference).
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.

    Returns:
        `(B, H, P)` outputs in the dtype of `x` (padding rows start from a zero state).
    """
    return torch.ops.vllm_mamba.ssd_state_update(
        ssm_states, x, dt, A, B_, C, D_skip, dt_bias, dt_softplus, state_indices
    )


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """Mamba2's gated RMSNorm in one pass per row; see `gated_rms_norm_ref`.

    Args:
        x, z: `(T, I)`, float32 or bfloat16 (rows may be strided); weight: `(I,)`.
        group_size: channels per normalisation group; eps: added to the mean square.

    Returns:
        `(T, I)` in the dtype of `x`.
    """
    return torch.ops.vllm_mamba.gated_rms_norm(x, z, weight, group_size, eps)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes the tokens' keys and values to their cache slots; see `reshape_and_cache_ref`.

    Args:
        key, value: `(T, Hkv, D)`; k_cache, v_cache: `(NB, BS, Hkv, D)`, updated in place.
        slot_mapping: `(T,)` int; slots `< 0` are skipped.
    """
    torch.ops.vllm_mamba.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per row over its paged context; see `paged_decode_attention_ref`.

    Args:
        query: `(B, Hq, D)`; k_cache, v_cache: `(NB, BS, Hkv, D)` float32, bfloat16 or float16.
        block_tables: `(B, max_blocks)` int; seq_lens: `(B,)` int, 0 for padding rows.
        scale: the softmax scale.

    Returns:
        `(B, Hq, D)` in the query's dtype.
    """
    return torch.ops.vllm_mamba.paged_decode_attention(
        query, k_cache, v_cache, block_tables, seq_lens, float(scale)
    )


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal varlen attention over the cached context; see `paged_prefill_attention_ref`.

    Args:
        query: `(T, Hq, D)`; k_cache, v_cache: `(NB, BS, Hkv, D)`.
        block_tables: `(P, max_blocks)` int; query_start_loc: `(P + 1,)` int;
            seq_lens: `(P,)` int, context plus chunk of each sequence.
        scale: the softmax scale.

    Returns:
        `(T, Hq, D)` in the query's dtype; tokens after `qsl[P]` are zeros.
    """
    return torch.ops.vllm_mamba.paged_prefill_attention(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, float(scale)
    )


def gated_delta_varlen(
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
    """The chunked gated delta rule over packed sequences; see `gated_delta_varlen_ref`.

    Args:
        q, k: `(T, Hk, Dk)`; v: `(T, Hv, Dv)`, one dtype (float32 or bfloat16), views with a
            free token stride read in place; a, b: `(T, Hv)`; A_log, dt_bias: `(Hv,)`.
        beta_scale: `beta = beta_scale * sigmoid(b)`.
        ssm_states: `(S, Hv, Dk, Dv)`, contiguous, float32 or bfloat16; updated in place.
        query_start_loc: `(B + 1,)`; state_indices: `(B,)`; has_initial_state: `(B,)` bool.
        chunk_size: tokens per chunk.

    Returns:
        `(T, Hv, Dv)` outputs in the dtype of `v`.
    """
    return torch.ops.vllm_mamba.gated_delta_varlen(
        q, k, v, a, b, A_log, dt_bias, float(beta_scale), ssm_states, query_start_loc,
        state_indices, has_initial_state, chunk_size,
    )  # fmt: skip


def gated_delta_update(
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
    """One token per row of the gated delta rule, in place; see `gated_delta_update_ref`.

    Args:
        q, k: `(B, Hk, Dk)`; v: `(B, Hv, Dv)`, one dtype; a, b: `(B, Hv)`;
            A_log, dt_bias: `(Hv,)`.
        beta_scale: `beta = beta_scale * sigmoid(b)`.
        ssm_states: `(S, Hv, Dk, Dv)`, contiguous; updated in place for non-padding rows.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.

    Returns:
        `(B, Hv, Dv)` outputs in the dtype of `v` (zeros for padding rows).
    """
    return torch.ops.vllm_mamba.gated_delta_update(
        q, k, v, a, b, A_log, dt_bias, float(beta_scale), ssm_states, state_indices
    )


def rms_norm_gated(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`weight * rmsnorm(x) * silu(z)` over the last dimension; see `rms_norm_gated_ref`.

    Args:
        x, z: `(..., Dv)`, float32 or bfloat16; weight: `(Dv,)`; eps: the norm's epsilon.

    Returns:
        `(..., Dv)` in x's dtype.
    """
    return torch.ops.vllm_mamba.rms_norm_gated(x, z, weight, float(eps))


register_op_impl(
    gated_delta.FAMILY,
    "cpp",
    varlen=gated_delta_varlen,
    update=gated_delta_update,
    norm_gate=rms_norm_gated,
)


def kda_varlen(
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
    chunk_size: int = kda.CHUNK_SIZE,
) -> torch.Tensor:
    """The chunked KDA rule over packed sequences (`csrc/kda.cpp`); see `kda_varlen_ref`.

    Args:
        q, k: `(T, Hk, Dk)`; v: `(T, Hv, Dv)`, one dtype (float32 or bfloat16), views with a
            free token stride read in place; a: `(T, Hv * Dk)`; b: `(T, Hv)`; A_log: `(Hv,)`;
            dt_bias: `(Hv * Dk,)`.
        ssm_states: `(S, Hv, Dk, Dv)`, contiguous, float32 or bfloat16; updated in place.
        query_start_loc: `(B + 1,)`; state_indices: `(B,)`; has_initial_state: `(B,)` bool.
        chunk_size: tokens per chunk (`kda.CHUNK_SIZE`, 12, is the measured best).

    Returns:
        `(T, Hv, Dv)` outputs in q's dtype.
    """
    return torch.ops.vllm_mamba.kda_varlen(
        q, k, v, a, b, A_log, dt_bias, ssm_states, query_start_loc, state_indices,
        has_initial_state, chunk_size,
    )  # fmt: skip


def kda_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One token per row of the KDA rule, in place (`csrc/kda.cpp`); see `kda_update_ref`.

    Args:
        q, k: `(B, Hk, Dk)`; v: `(B, Hv, Dv)`, one dtype; a: `(B, Hv * Dk)`; b: `(B, Hv)`;
            A_log: `(Hv,)`; dt_bias: `(Hv * Dk,)`.
        ssm_states: `(S, Hv, Dk, Dv)`, contiguous; updated in place for non-padding rows.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.

    Returns:
        `(B, Hv, Dv)` outputs in q's dtype (zeros for padding rows).
    """
    return torch.ops.vllm_mamba.kda_update(q, k, v, a, b, A_log, dt_bias, ssm_states, state_indices)


def kda_norm_gate(
    o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`weight * rmsnorm(o) * sigmoid(gate)` over the last dimension; see `kda_norm_gate_ref`.

    Args:
        o, gate: `(..., Dv)`, float32 or bfloat16; weight: `(Dv,)`; eps: the norm's epsilon.

    Returns:
        `(..., Dv)` in o's dtype.
    """
    return torch.ops.vllm_mamba.kda_norm_gate(o, gate, weight, float(eps))


register_op_impl(
    kda.FAMILY,
    "cpp",
    varlen=kda_varlen,
    update=kda_update,
    norm_gate=kda_norm_gate,
)


def mla_cache_write(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes the tokens' latent rows to their cache slots; see `mla_cache_write_ref`.

    Args:
        latent: `(T, L)`; cache: `(NB, BS, L)` float32, bfloat16 or float16, updated in place.
        slot_mapping: `(T,)` int; slots `< 0` are skipped.
    """
    torch.ops.vllm_mamba.mla_cache_write(latent, cache, slot_mapping)


def mla_decode_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
) -> torch.Tensor:
    """Absorbed MLA decode over the paged latents; see `mla_decode_attention_ref`.

    Args:
        query: `(B, Hq, L)`; cache: `(NB, BS, L)`.
        block_tables: `(B, max_blocks)` int; seq_lens: `(B,)` int, 0 for padding rows.
        scale: the softmax scale; v_dim: the value columns of a latent row.

    Returns:
        `(B, Hq, v_dim)` in the query's dtype.
    """
    return torch.ops.vllm_mamba.mla_decode_attention(
        query, cache, block_tables, seq_lens, float(scale), int(v_dim)
    )


def mla_prefill_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
) -> torch.Tensor:
    """Causal absorbed MLA over the cached latents; see `mla_prefill_attention_ref`.

    Args:
        query: `(T, Hq, L)`; cache: `(NB, BS, L)`.
        block_tables: `(P, max_blocks)` int; query_start_loc: `(P + 1,)` int;
            seq_lens: `(P,)` int, context plus chunk of each sequence.
        scale: the softmax scale; v_dim: the value columns of a latent row.

    Returns:
        `(T, Hq, v_dim)` in the query's dtype; tokens after `qsl[P]` are zeros.
    """
    return torch.ops.vllm_mamba.mla_prefill_attention(
        query, cache, block_tables, query_start_loc, seq_lens, float(scale), int(v_dim)
    )


register_op_impl(
    mla_attention.FAMILY,
    "cpp",
    cache_write=mla_cache_write,
    decode_attention=mla_decode_attention,
    prefill_attention=mla_prefill_attention,
)


def short_conv_update(
    bcx: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One decode token per row of LFM2's gated short conv; see `short_conv_update_ref`.

    Args:
        bcx: `(B, 3D)` the in_proj output `[B | C | x]`, float32 or bfloat16 (a view with a
            free row stride is read in place).
        conv_states: `(S, D, K - 1)`, contiguous, float32 or bfloat16; updated in place for
            non-padding rows.
        weight: `(D, K)`, 2 <= K <= 8; bias: `(D,)` or None.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.

    Returns:
        `(B, D)` `C * conv(B * x)` in bcx's dtype (padding rows use a zero history).
    """
    return torch.ops.vllm_mamba.short_conv_update(bcx, conv_states, weight, bias, state_indices)


def short_conv_varlen(
    bcx: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """LFM2's gated short conv over packed sequences; see `short_conv_varlen_ref`.

    Args:
        bcx: `(T, 3D)` the in_proj output `[B | C | x]`, float32 or bfloat16.
        conv_states: `(S, D, K - 1)`, contiguous, float32 or bfloat16; updated in place.
        weight: `(D, K)`, 2 <= K <= 8; bias: `(D,)` or None.
        query_start_loc: `(B + 1,)`; state_indices: `(B,)`; has_initial_state: `(B,)` bool.

    Returns:
        `(T, D)` `C * conv(B * x)` in bcx's dtype.
    """
    return torch.ops.vllm_mamba.short_conv_varlen(
        bcx, conv_states, weight, bias, query_start_loc, state_indices, has_initial_state
    )


register_op_impl(short_conv.FAMILY, "cpp", update=short_conv_update, varlen=short_conv_varlen)


def rwkv7_varlen(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """RWKV-7's wkv over packed sequences (`csrc/rwkv.cpp`); see `wkv7_varlen_ref`.

    Args:
        r, w, k, a, b: `(T, H, Dk)`; v: `(T, H, Dv)`; each float32 or bfloat16 (w may be
            float32 with the others bfloat16), views with a free token stride read in place.
        states: `(S, H, Dv, Dk)`, contiguous, float32 or bfloat16; updated in place.
        query_start_loc: `(B + 1,)`; state_indices: `(B,)`; has_initial_state: `(B,)` bool.

    Returns:
        `(T, H, Dv)` in r's dtype.
    """
    return torch.ops.vllm_mamba.rwkv7_varlen(
        r, w, k, v, a, b, states, query_start_loc, state_indices, has_initial_state
    )


def rwkv7_update(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    states: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One token per row of RWKV-7's wkv, in place (`csrc/rwkv.cpp`); see `wkv7_update_ref`.

    Args:
        r, w, k, a, b: `(B, H, Dk)`; v: `(B, H, Dv)`; float32 or bfloat16.
        states: `(S, H, Dv, Dk)`, contiguous; updated in place for non-padding rows.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.

    Returns:
        `(B, H, Dv)` in r's dtype (padding rows: the output of a zero state).
    """
    return torch.ops.vllm_mamba.rwkv7_update(r, w, k, v, a, b, states, state_indices)


def rwkv7_shift_mix(
    x: torch.Tensor, shift: torch.Tensor, state_indices: torch.Tensor, mixes: torch.Tensor
) -> torch.Tensor:
    """Decode rows' token shift and mixes (`csrc/rwkv.cpp`); see `shift_mix_ref`.

    Args:
        x: `(B, H)` float32 or bfloat16 (a free row stride read in place); shift: `(S, H)`,
            contiguous, updated in place; state_indices: `(B,)`, `PAD_SLOT_ID` rows neither
            read nor write; mixes: `(M, 1, H)` or `(H,)`.

    Returns:
        `(M, B, H)` (`(B, H)` for `(H,)` mixes) in x's dtype.
    """
    return torch.ops.vllm_mamba.rwkv7_shift_mix(x, shift, state_indices, mixes)


def rwkv7_fused_update(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    g: torch.Tensor,
    v_first: torch.Tensor | None,
    v_gate: torch.Tensor | None,
    k_k: torch.Tensor,
    k_a: torch.Tensor,
    r_k: torch.Tensor,
    gn_weight: torch.Tensor,
    gn_bias: torch.Tensor,
    gn_eps: float,
    states: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One decode token per row of RWKV-7's time mix between its projections and `o_proj`
    (`csrc/rwkv.cpp`); see `fused_update_ref`.

    Args:
        r, w, k, a: `(B, C)`; v, g, v_first, v_gate: `(B, CV)` (v_first, v_gate None in layer
            0); each float32 or bfloat16, views with a free row stride read in place.
        k_k, k_a: `(C,)`; r_k: `(NH, Dk)`; gn_weight, gn_bias: `(CV,)`.
        states: `(S, NH, Dv, Dk)`, contiguous, float32 or bfloat16; updated in place.
        state_indices: `(B,)`, `PAD_SLOT_ID` rows skipped (outputs of a zero state).

    Returns:
        `(B, CV)` in g's dtype; math in float32.
    """
    return torch.ops.vllm_mamba.rwkv7_fused_update(
        r, w, k, v, a, g, v_first, v_gate, k_k, k_a, r_k, gn_weight, gn_bias, gn_eps, states,
        state_indices,
    )  # fmt: skip


def rwkv7_decode_layer(
    hidden: torch.Tensor,
    params: list[torch.Tensor | None],
    tm_shift: torch.Tensor,
    wkv_states: torch.Tensor,
    cm_shift: torch.Tensor,
    state_indices: torch.Tensor,
    v_first: torch.Tensor | None,
    norm_eps: float,
    gn_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One RWKV-7 decoder layer's decode step in one call (`csrc/fused_decode_rwkv7.cpp`);
    see `decode_layer_ref`."""
    return torch.ops.vllm_mamba.fused_rwkv7_decode(
        hidden, params, tm_shift, wkv_states, cm_shift, state_indices, v_first, norm_eps, gn_eps
    )


register_op_impl(
    rwkv7.FAMILY,
    "cpp",
    varlen=rwkv7_varlen,
    update=rwkv7_update,
    shift_mix=rwkv7_shift_mix,
    fused_update=rwkv7_fused_update,
    decode_layer=rwkv7_decode_layer,
)


def rwkv4_varlen(
    w: torch.Tensor,
    u: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_states: torch.Tensor,
    den_states: torch.Tensor,
    max_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """RWKV-4's WKV over packed sequences (`csrc/rwkv.cpp`); see `wkv4_varlen_ref`.

    Args:
        w: `(C,)` `-exp(time_decay)`; u: `(C,)` `time_first`; k, v: `(T, C)`, float32 or
            bfloat16.
        num_states, den_states, max_states: `(S, C)` float32, contiguous; updated in place.
        query_start_loc: `(B + 1,)`; state_indices: `(B,)`; has_initial_state: `(B,)` bool.

    Returns:
        `(T, C)` in v's dtype.
    """
    return torch.ops.vllm_mamba.rwkv4_varlen(
        w, u, k, v, num_states, den_states, max_states, query_start_loc, state_indices,
        has_initial_state,
    )  # fmt: skip


def rwkv4_update(
    w: torch.Tensor,
    u: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_states: torch.Tensor,
    den_states: torch.Tensor,
    max_states: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One token per row of RWKV-4's WKV, in place (`csrc/rwkv.cpp`); see `wkv4_update_ref`.

    Args:
        w, u: `(C,)`; k, v: `(B, C)`; the states `(S, C)` float32, contiguous, updated in
            place for non-padding rows; state_indices: `(B,)`.

    Returns:
        `(B, C)` in v's dtype (padding rows: the output of a fresh state).
    """
    return torch.ops.vllm_mamba.rwkv4_update(
        w, u, k, v, num_states, den_states, max_states, state_indices
    )


register_op_impl(rwkv4.FAMILY, "cpp", varlen=rwkv4_varlen, update=rwkv4_update)


def _onednn_linear_available() -> bool:
    """Whether torch has oneDNN's linear op, unless `VLLM_MAMBA_ONEDNN_LINEAR=0`."""
    if not envs.VLLM_MAMBA_ONEDNN_LINEAR:
        return False
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN_LINEAR = _onednn_linear_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x (..., K) @ weight (N, K)^T + bias` -> `(..., N)`, by the fastest path for the shape.

    Up to `SMALL_BATCH` rows (decode) the C++ kernel `linear_small_batch` streams the weight
    once at close to memory speed. More float32 rows (prefill, many-stream decode: bound by
    compute) go through oneDNN's float32 GEMM (`mkldnn._linear_pointwise`, full float32
    precision), which reached 2.3x the rate of `F.linear`'s MKL GEMM on the AMD CPUs measured
    (`benchmarks/README.md`). bfloat16 weights on a CPU without bfloat16 instructions
    (`native_bf16`) go through `bf16_linear`, which widens them to float32 in registers or
    blocks instead of `F.linear`'s slow bfloat16 path there. Other dtypes, devices and
    autograd use `F.linear`.
    """
    on_cpu = x.device.type == "cpu" and not torch.is_grad_enabled() and weight.is_contiguous()
    if (
        on_cpu
        and x.dim() == 2
        and x.shape[0] <= SMALL_BATCH
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype in (torch.float32, torch.bfloat16)
    ):
        return torch.ops.vllm_mamba.linear_small_batch(x, weight, bias)
    if (
        on_cpu
        and x.dim() == 2
        and weight.dtype == torch.bfloat16
        and x.dtype in (torch.float32, torch.bfloat16)
        and not native_bf16()
    ):
        return torch.ops.vllm_mamba.bf16_linear(x, weight, bias)
    if (
        _ONEDNN_LINEAR
        and on_cpu
        and x.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and x.numel() > 0
    ):
        return _onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


GEMM_ROWS = 512  # rows of one oneDNN call, at most (`csrc/onednn_linear.h`: kGemmRows)


def gemm_rows(m: int) -> int:
    """The rows one oneDNN call runs for `m` rows (1 <= m <= GEMM_ROWS): up to 32 a multiple
    of 8, above four sizes per doubling (m in (2^j, 2^(j+1)] rounds up to a multiple of
    2^(j-2)). The same rule as `gemm_rows` in `csrc/onednn_linear.h`."""
    if m <= 32:
        return -(-m // 8) * 8
    step = 1 << max(0, (m - 1).bit_length() - 3)
    return -(-m // step) * step


def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """oneDNN's float32 GEMM on a bounded set of row counts.

    oneDNN JIT-compiles a primitive for every distinct row count and caches it twice (its
    primitive cache and ideep's, 1,024 entries each, about 0.6 MB per shape whatever the
    weight's size); with a row count that changes with every step's batch, a server's RSS grew
    for thousands of requests (issue 33's soak). So at most `GEMM_ROWS` rows go in one call,
    padded with zero rows to `gemm_rows(rows)`: 20 shapes per weight, all seen soon, for at most 7
    extra rows up to 32 (where the weight's streaming dominates) and under 25% above; a new shape
    also costs a JIT compile (about 1 ms).
    """
    rows = x.reshape(-1, x.shape[-1])
    parts = []
    for start in range(0, rows.shape[0], GEMM_ROWS):
        part = rows[start : start + GEMM_ROWS]
        m = part.shape[0]
        padded = gemm_rows(m)
        if padded != m:
            part = torch.cat([part, part.new_zeros(padded - m, part.shape[1])])
        parts.append(torch.ops.mkldnn._linear_pointwise(part, weight, bias, "none", [], "")[:m])
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def make_ops() -> MambaOps:
    """Builds the ops table of the C++ backend.

    Returns:
        The wrappers, under the name "cpp".
    """
    return MambaOps(
        name="cpp",
        causal_conv1d_varlen=causal_conv1d_varlen,
        causal_conv1d_update=causal_conv1d_update,
        selective_scan_varlen=selective_scan_varlen,
        selective_state_update=selective_state_update,
        linear=linear,
        ssd_chunk_scan_varlen=ssd_chunk_scan_varlen,
        ssd_state_update=ssd_state_update,
        gated_rms_norm=gated_rms_norm,
        reshape_and_cache=reshape_and_cache,
        paged_decode_attention=paged_decode_attention,
        paged_prefill_attention=paged_prefill_attention,
        int8_linear=int8_linear_cpp if has_int8_kernel() else int8_linear_ref,
        int4_linear=int4_linear_cpp if has_int4_kernel() else int4_linear_ref,
    )
