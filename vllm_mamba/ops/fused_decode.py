"""The `fused_decode` op family: one kernel call per Mamba or Mamba2 layer for a few sequences.

Decode with a few sequences reads every weight once per token, and the unfused layer spends
a third of its time in per-op Python and dispatch. The family's `mamba` and `mamba2` ops (C++:
`torch.ops.vllm_mamba.fused_mamba_decode` / `fused_mamba2_decode`, `csrc/fused_decode_mamba*.cpp`,
bound in `vllm_mamba.ops.cpu_kernels`; the ops table's `fused_mamba_decode` /
`fused_mamba2_decode`, None for a backend without them) run a whole layer (optionally
with the block's RMSNorm and residual) in one call: up to 8 rows with weight-streaming
matrix-vector products inside one parallel region, more rows with torch's GEMMs between
fused parallel stages (conv, state update, gate or gated norm, residual). Their pure-PyTorch twins
`fused_mamba_decode_ref` / `fused_mamba2_decode_ref` compose the reference ops of the unfused
path, so the two paths have one definition.

`params` is a list of the layer's tensors in a fixed order (`MAMBA_PARAMS`, `MAMBA2_PARAMS`);
absent optional entries are None. Each projection weight (`*_proj_w`) is float32, bfloat16,
int8 (`quantization="int8"`) with its per-row float32 scale in the matching `*_proj_scale`
entry, or 4-bit (`quantization="int4"`: uint8 `(rows, cols/2)` with its `(rows, cols/32)`
float16 group scales there; None for a float weight); every other entry is a contiguous
float32 tensor. `int_dot` (`quantization="w8a8"` / `"w4a8"`): the int8 and 4-bit weights
multiply activations quantised to int8 blocks of 32 (`vllm_mamba.ops.int_dot_linear`); float
weights ignore it. The conv and SSM states are float32 or bfloat16 each (`ssm_state_dtype`),
whatever the weights.

Glossary: B decode rows, H hidden, I inner channels, N state size, S state slots; Mamba2: NH
heads of P (`I = NH P`), G groups, CD = I + 2 G N conv channels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from vllm_mamba.ops.causal_conv1d import causal_conv1d_update_ref
from vllm_mamba.ops.families import OpFamily, OpSpec
from vllm_mamba.ops.gated_rms_norm import gated_rms_norm_ref
from vllm_mamba.ops.int4_linear import dequantize_int4
from vllm_mamba.ops.int8_linear import dequantize_int8
from vllm_mamba.ops.int_dot_linear import w4a8_linear_ref, w8a8_linear_ref
from vllm_mamba.ops.selective_scan import selective_state_update_ref
from vllm_mamba.ops.ssd import ssd_state_update_ref

Tensor = torch.Tensor

MAMBA_PARAMS = (
    "norm_w", "in_proj_w", "in_proj_b", "conv_w", "conv_b", "x_proj_w", "dt_proj_w", "dt_proj_b",
    "A", "D", "out_proj_w", "out_proj_b", "in_proj_scale", "x_proj_scale", "dt_proj_scale",
    "out_proj_scale",
)  # fmt: skip
MAMBA2_PARAMS = (
    "norm_w", "in_proj_w", "in_proj_b", "conv_w", "conv_b", "dt_bias", "A", "D", "gate_norm_w",
    "out_proj_w", "out_proj_b", "in_proj_scale", "out_proj_scale",
)  # fmt: skip
# `params` by name: `list(MambaParams(**tensors))`; the fields are the names above, in the order
# of the C++ index constants (`csrc/fused_decode_mamba.cpp`, `fused_decode_mamba2.cpp`: `Param`).
MambaParams = NamedTuple("MambaParams", [(n, "Tensor | None") for n in MAMBA_PARAMS])
Mamba2Params = NamedTuple("Mamba2Params", [(n, "Tensor | None") for n in MAMBA2_PARAMS])

Params = list[torch.Tensor | None]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)` in float32 (the block norm, `RMSNorm`)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None = None,
    int_dot: bool = False,
) -> torch.Tensor:
    """`F.linear` in float32 whatever the weight dtype (int8 and 4-bit weights dequantised);
    with `int_dot` an int8 / 4-bit weight multiplies x quantised to int8 blocks
    (`w8a8_linear_ref` / `w4a8_linear_ref`)."""
    if int_dot and scale is not None:
        op = w4a8_linear_ref if weight.dtype == torch.uint8 else w8a8_linear_ref
        return op(x.float(), weight, scale, bias)
    if scale is None:
        w = weight.float()
    elif weight.dtype == torch.uint8:  # 4-bit, float16 group scales
        w = dequantize_int4(weight, scale, torch.float32)
    else:
        w = dequantize_int8(weight, scale, torch.float32)
    return F.linear(x, w, bias)


def _finish(
    hidden: torch.Tensor,
    mixed: torch.Tensor,
    with_norm: bool,
    out_dtype: torch.dtype,
    residual_scale: float = 1.0,
) -> torch.Tensor:
    """Adds the residual (block mode; `mixed` times a residual multiplier other than 1) and
    casts to `out_dtype`."""
    if with_norm and residual_scale != 1.0:
        mixed = mixed * residual_scale
    out = hidden.float() + mixed if with_norm else mixed
    return out.to(out_dtype)


def fused_mamba_decode_ref(
    hidden: torch.Tensor,
    params: Params,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    norm_eps: float,
    mixer_eps: float,
    out_dtype: torch.dtype,
    src_state_indices: torch.Tensor | None = None,
    int_dot: bool = False,
) -> torch.Tensor:
    """One Mamba layer's decode step from the reference ops; states advanced in place.

    Args:
        hidden: `(B, H)` the block input (norm given) or the mixer input (norm_w None).
        params: the tensors named by `MAMBA_PARAMS`: norm_w `(H,)` or None, in_proj_w
            `(2I, H)`, in_proj_b, conv_w `(I, K)`, conv_b, x_proj_w `(R + 2N, I)`, dt_proj_w
            `(I, R)`, dt_proj_b `(I,)`, A `(I, N)`, D `(I,)`, out_proj_w `(H, I)`, out_proj_b, and
            the four weights' scales (None, `(rows,)` float32 for int8, `(rows, cols/32)`
            float16 for 4-bit).
        conv_states: `(S, I, K - 1)`; ssm_states: `(S, I, N)`; updated in place.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.
        norm_eps: the block norm's epsilon (unused without norm_w).
        mixer_eps: FalconMamba's epsilon of the weightless norms of dt, B and C; < 0: none.
        out_dtype: the result's dtype (float32 or the model dtype, as the unfused path).
        src_state_indices: `(B,)` the slot each row reads its state from (`_chained`).
        int_dot: the int8 / 4-bit weights take integer dot products (see the module).

    Returns:
        `(B, H)`: hidden + mixer(norm(hidden)) with norm_w, else mixer(hidden).
    """
    if src_state_indices is not None:
        return _chained(
            fused_mamba_decode_ref, hidden, (conv_states, ssm_states), state_indices,
            src_state_indices, params, conv_states, ssm_states, norm_eps=norm_eps,
            mixer_eps=mixer_eps, out_dtype=out_dtype, int_dot=int_dot,
        )  # fmt: skip
    p = dict(zip(MAMBA_PARAMS, params, strict=True))
    x = hidden.float()
    xn = _rms_norm(x, p["norm_w"], norm_eps) if p["norm_w"] is not None else x
    u, z = _linear(xn, p["in_proj_w"], p["in_proj_b"], p["in_proj_scale"], int_dot).chunk(2, -1)
    xc = causal_conv1d_update_ref(u, conv_states, p["conv_w"], p["conv_b"], state_indices)
    rank = p["dt_proj_w"].shape[1]
    nstate = p["A"].shape[1]
    ts, B, C = _linear(xc, p["x_proj_w"], None, p["x_proj_scale"], int_dot).split(
        [rank, nstate, nstate], dim=-1
    )
    if mixer_eps >= 0:
        ts, B, C = (
            t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + mixer_eps) for t in (ts, B, C)
        )
    dt = _linear(ts, p["dt_proj_w"], None, p["dt_proj_scale"], int_dot)  # (B, I)
    y = selective_state_update_ref(
        ssm_states, xc, dt, p["A"], B, C, p["D"], z, p["dt_proj_b"], True, state_indices
    )
    mixed = _linear(y, p["out_proj_w"], p["out_proj_b"], p["out_proj_scale"], int_dot)
    return _finish(hidden, mixed, p["norm_w"] is not None, out_dtype)


def fused_mamba2_decode_ref(
    hidden: torch.Tensor,
    params: Params,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    n_groups: int,
    group_size: int,
    norm_eps: float,
    gate_eps: float,
    out_dtype: torch.dtype,
    src_state_indices: torch.Tensor | None = None,
    int_dot: bool = False,
    residual_scale: float = 1.0,
) -> torch.Tensor:
    """One Mamba2 layer's decode step from the reference ops; states advanced in place.

    Args:
        hidden: `(B, H)` the block input (norm given) or the mixer input (norm_w None).
        params: the tensors named by `MAMBA2_PARAMS`: norm_w `(H,)` or None, in_proj_w
            `(I + CD + NH, H)` (rows z, x B C, dt), in_proj_b, conv_w `(CD, K)`, conv_b,
            dt_bias `(NH,)`, A `(NH,)`, D `(NH,)`, gate_norm_w `(I,)`, out_proj_w `(H, I)`,
            out_proj_b, in_proj_scale and out_proj_scale (None, float32 for int8, float16 for
            4-bit).
        conv_states: `(S, CD, K - 1)`; ssm_states: `(S, NH, P, N)`; updated in place.
        state_indices: `(B,)` slot per row, `PAD_SLOT_ID` rows are skipped.
        n_groups: G; group_size: channels per group of the gated norm.
        norm_eps: the block norm's epsilon; gate_eps: the gated norm's.
        out_dtype: the result's dtype (float32 or the model dtype, as the unfused path).
        src_state_indices: `(B,)` the slot each row reads its state from (`_chained`).
        int_dot: the int8 / 4-bit weights take integer dot products (see the module).
        residual_scale: with norm_w, the layer's residual multiplier rm.

    Returns:
        `(B, H)`: hidden + rm * mixer(norm(hidden)) with norm_w, else mixer(hidden).
    """
    if src_state_indices is not None:
        return _chained(
            fused_mamba2_decode_ref, hidden, (conv_states, ssm_states), state_indices,
            src_state_indices, params, conv_states, ssm_states, n_groups=n_groups,
            group_size=group_size, norm_eps=norm_eps, gate_eps=gate_eps, out_dtype=out_dtype,
            int_dot=int_dot, residual_scale=residual_scale,
        )  # fmt: skip
    p = dict(zip(MAMBA2_PARAMS, params, strict=True))
    batch = hidden.shape[0]
    _, heads, head_dim, nstate = ssm_states.shape
    inter, gn = heads * head_dim, n_groups * nstate
    x = hidden.float()
    xn = _rms_norm(x, p["norm_w"], norm_eps) if p["norm_w"] is not None else x
    zxbcdt = _linear(xn, p["in_proj_w"], p["in_proj_b"], p["in_proj_scale"], int_dot)
    z, xbc, dt = zxbcdt.split([inter, inter + 2 * gn, heads], dim=-1)
    xbc = causal_conv1d_update_ref(xbc, conv_states, p["conv_w"], p["conv_b"], state_indices)
    xs, B, C = xbc.split([inter, gn, gn], dim=-1)
    y = ssd_state_update_ref(
        ssm_states, xs.reshape(batch, heads, head_dim), dt, p["A"],
        B.reshape(batch, n_groups, nstate), C.reshape(batch, n_groups, nstate), p["D"],
        p["dt_bias"], True, state_indices,
    )  # fmt: skip
    g = gated_rms_norm_ref(y.reshape(batch, inter), z, p["gate_norm_w"], group_size, gate_eps)
    mixed = _linear(g, p["out_proj_w"], p["out_proj_b"], p["out_proj_scale"], int_dot)
    return _finish(hidden, mixed, p["norm_w"] is not None, out_dtype, residual_scale)


def _chained(
    layer: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    states: tuple[torch.Tensor, ...],
    dst: torch.Tensor,
    src: torch.Tensor,
    params: Params,
    *state_args: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """`layer` row by row, row b starting from the state of slot `src[b]` (copied into its
    slot `dst[b]` first): rows that read what an earlier row wrote form a chain (speculative
    decoding keeps each position's state in its own slot)."""
    outs = []
    for b in range(hidden.shape[0]):
        s, d = int(src[b]), int(dst[b])
        if d >= 0 and s != d:
            for state in states:
                state[d] = state[s]
        outs.append(layer(hidden[b : b + 1], params, *state_args, dst[b : b + 1], **kwargs))
    return torch.cat(outs)


class FusedMambaDecodeOp(Protocol):
    def __call__(
        self, hidden: Tensor, params: Params, conv_states: Tensor, ssm_states: Tensor,
        state_indices: Tensor, norm_eps: float, mixer_eps: float, out_dtype: torch.dtype,
        src_state_indices: Tensor | None = None, int_dot: bool = False,
    ) -> Tensor: ...  # fmt: skip


class FusedMamba2DecodeOp(Protocol):
    def __call__(
        self, hidden: Tensor, params: Params, conv_states: Tensor, ssm_states: Tensor,
        state_indices: Tensor, n_groups: int, group_size: int, norm_eps: float, gate_eps: float,
        out_dtype: torch.dtype, src_state_indices: Tensor | None = None, int_dot: bool = False,
        residual_scale: float = 1.0,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    "fused_decode",
    {
        "mamba": OpSpec(FusedMambaDecodeOp, fused_mamba_decode_ref),
        "mamba2": OpSpec(FusedMamba2DecodeOp, fused_mamba2_decode_ref),
    },
)
