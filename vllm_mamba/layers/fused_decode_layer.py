"""How the Mamba and Mamba2 mixers hand a decode-only step to the fused decode kernels.

`mamba_decode_block` / `mamba2_decode_block` run one layer's step in one call of the ops
table's `fused_mamba_decode` / `fused_mamba2_decode` (`vllm_mamba.ops.fused_decode`), with the
block's RMSNorm and residual when the block passes its norm, or return None where the fused
kernel does not apply: no kernel in the table, prefill rows, autograd, a mixer that declares
`fused_decode = False` (a subclass that changes the math: Jamba's normed dt/B/C, Falcon-H1's
multipliers), or projections
that are not plain `Linear`s with float32 / bfloat16 weights of the model dtype, int8
weights with per-row scales (`quantization="int8"`) or 4-bit weights with group scales
(`quantization="int4"`; tensor-parallel layers are not). The
caller then runs its unfused path, which is the definition.

The parameter list of each (mixer, norm) pair is built once and kept on the mixer; it is
rebuilt when the mixer's derived `A` changes (`process_weights_after_loading`).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.layers.cache_layers import LayerState
from vllm_mamba.layers.layernorm import GatedRMSNorm, RMSNorm
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.quantization import is_int4_linear, is_int8_linear

Params = list[torch.Tensor | None]
# A layer's fused parameters and its model dtype (that of its activations).
Prepared = tuple[Params, torch.dtype]
# Mamba rows up to which the fused layer runs. Above it the kernel's GEMM path was measured
# no faster than the unfused one (its per-channel selective-scan stage costs as much as the
# dispatch it saves: benchmarks/README.md), so larger Mamba batches stay unfused. Mamba2's
# fused layer runs at every batch size.
MAMBA_MAX_ROWS = 8
CHAIN_MAX_ROWS = 64  # rows of a step with speculative chains that the fused layers take
_FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def plain_weight(
    linear: nn.Module, linear_op: object
) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype] | None:
    """`(weight, scale, model dtype)` of an unmodified `Linear`, else None.

    The layer runs the table's float product (scale None, the weight's dtype) or is an int8 or
    4-bit layer (its `weight_scale`, the dtype of its activations).
    """
    weight = getattr(linear, "weight", None)
    if (
        type(linear) is not Linear
        or not isinstance(weight, torch.Tensor)
        or weight.device.type != "cpu"
        or not weight.is_contiguous()
    ):
        return None
    if is_int8_linear(linear) or is_int4_linear(linear):
        return weight.detach(), linear.weight_scale, linear.activation_dtype
    if linear.linear_op is not linear_op or weight.dtype not in _FLOAT_DTYPES:
        return None
    return weight.detach(), None, weight.dtype


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    """A small parameter as contiguous float32 (None stays None)."""
    return None if t is None else t.detach().float().contiguous()


def _weights(
    mixer: nn.Module, names: tuple[str, ...]
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], torch.dtype] | None:
    """The named projections' weights and scales and their one model dtype, or None."""
    found = [plain_weight(getattr(mixer, n), mixer.ops.linear) for n in names]
    if any(f is None for f in found) or len({f[2] for f in found}) != 1:
        return None
    return [f[0] for f in found], [f[1] for f in found], found[0][2]


def _mamba_params(mixer: nn.Module, norm: RMSNorm | None) -> Prepared | None:
    """`MAMBA_PARAMS` of a `MambaMixer` (norm weight first) and its model dtype, or None."""
    found = _weights(mixer, ("in_proj", "x_proj", "dt_proj", "out_proj"))
    if found is None:
        return None
    (in_w, x_w, dt_w, out_w), scales, dtype = found
    return [
        _f32(norm.weight) if norm is not None else None, in_w, _f32(mixer.in_proj.bias),
        _f32(mixer.conv_weight), _f32(mixer.conv1d.bias), x_w, dt_w, _f32(mixer.dt_proj.bias),
        mixer.A.contiguous(), _f32(mixer.D), out_w, _f32(mixer.out_proj.bias), *scales,
    ], dtype  # fmt: skip


def _mamba2_params(mixer: nn.Module, norm: RMSNorm | None) -> Prepared | None:
    """`MAMBA2_PARAMS` of a `Mamba2Mixer` (norm weight first) and its model dtype, or None."""
    found = _weights(mixer, ("in_proj", "out_proj"))
    if found is None or type(mixer.norm) is not GatedRMSNorm:
        return None
    (in_w, out_w), scales, dtype = found
    return [
        _f32(norm.weight) if norm is not None else None, in_w, _f32(mixer.in_proj.bias),
        _f32(mixer.conv_weight), _f32(mixer.conv1d.bias), _f32(mixer.dt_bias),
        mixer.A.contiguous(), _f32(mixer.D), _f32(mixer.norm.weight), out_w,
        _f32(mixer.out_proj.bias), *scales,
    ], dtype  # fmt: skip


def _cached_params(mixer: nn.Module, norm: RMSNorm | None, build) -> Prepared | None:  # noqa: ANN001
    """The parameters of (mixer, norm), built on first use and after `A` changes."""
    cache = mixer.__dict__.setdefault("_fused_decode_params", {})
    key = None if norm is None else id(norm)
    entry = cache.get(key)
    if entry is None or entry[0] is not mixer.A:
        entry = cache[key] = (mixer.A, build(mixer, norm))
    return entry[1]


def _states_apply(state: LayerState) -> bool:
    """States the kernels read: float32 or bfloat16 each (any `ssm_state_dtype` but float16)."""
    return state["conv"].dtype in _FLOAT_DTYPES and state["ssm"].dtype in _FLOAT_DTYPES


def _applies(hidden: torch.Tensor, meta: MambaMetadata) -> bool:
    """A decode-only step (every row a decode; with speculative chains, up to `CHAIN_MAX_ROWS`
    rows, which the kernels run in order), without autograd."""
    rows = hidden.shape[0]
    if meta.num_prefills or torch.is_grad_enabled():
        return False
    if meta.decode_waves and (meta.decode_chain_src is None or rows > CHAIN_MAX_ROWS):
        return False
    return meta.num_decodes == rows > 0


def _slots(meta: MambaMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots the rows write their states to, and read them from when those differ
    (speculative chains: each position's state in its own slot)."""
    if meta.decode_waves:
        assert meta.decode_chain_dst is not None
        return meta.decode_chain_dst, meta.decode_chain_src
    return meta.decode_state_indices, None


def _out_dtype(
    dtype: torch.dtype, hidden: torch.Tensor, norm: RMSNorm | None, fp32: bool
) -> torch.dtype:
    """The unfused path's result dtype: the mixer returns the model dtype `dtype`, the block
    `residual + mixed` float32 with a float32 residual (`residual_in_fp32`: `fp32`)."""
    if norm is not None and (fp32 or hidden.dtype == torch.float32):
        return torch.float32
    return dtype


def mamba_decode_block(
    mixer: nn.Module,
    hidden: torch.Tensor,
    norm: RMSNorm | None,
    residual_in_fp32: bool,
    meta: MambaMetadata,
) -> torch.Tensor | None:
    """A `MambaMixer`'s decode-only step in one fused call, or None where it does not apply.

    Args:
        mixer: the mixer (its bound `state` is advanced in place).
        hidden: `(T, H)`, the block input with `norm`, else the mixer input.
        norm: the block's pre-norm; given, the result is `residual + mixer(norm(hidden))`.
        residual_in_fp32: the block keeps its residual stream in float32.
        meta: as for the mixer's `forward`.

    Returns:
        `(T, H)` as the unfused block (or mixer) returns it, or None.
    """
    op = mixer.ops.fused_mamba_decode
    rows_apply = (hidden.shape[0] <= MAMBA_MAX_ROWS or meta.decode_waves) and _applies(hidden, meta)
    if op is None or not mixer.fused_decode or not rows_apply:
        return None
    state = mixer.state
    prepared = _cached_params(mixer, norm, _mamba_params)
    if prepared is None or not _states_apply(state):
        return None
    params, dtype = prepared
    eps = norm.variance_epsilon if norm is not None else 0.0
    mixer_eps = -1.0 if mixer.mixer_rms_eps is None else float(mixer.mixer_rms_eps)
    out_dtype = _out_dtype(dtype, hidden, norm, residual_in_fp32)
    dst, src = _slots(meta)
    return op(
        hidden, params, state["conv"], state["ssm"], dst, eps, mixer_eps, out_dtype, src
    )  # fmt: skip


def mamba2_decode_block(
    mixer: nn.Module,
    hidden: torch.Tensor,
    norm: RMSNorm | None,
    residual_in_fp32: bool,
    meta: MambaMetadata,
) -> torch.Tensor | None:
    """A `Mamba2Mixer`'s decode-only step in one fused call, or None where it does not apply.

    Args: as `mamba_decode_block`.

    Returns:
        `(T, H)` as the unfused block (or mixer) returns it, or None.
    """
    op = mixer.ops.fused_mamba2_decode
    if op is None or not mixer.fused_decode or not _applies(hidden, meta):
        return None
    state = mixer.state
    prepared = _cached_params(mixer, norm, _mamba2_params)
    if prepared is None or not _states_apply(state):
        return None
    params, dtype = prepared
    eps = norm.variance_epsilon if norm is not None else 0.0
    out_dtype = _out_dtype(dtype, hidden, norm, residual_in_fp32)
    dst, src = _slots(meta)
    return op(
        hidden, params, state["conv"], state["ssm"], dst, mixer.n_groups,
        mixer.norm.group_size, eps, mixer.norm.variance_epsilon, out_dtype, src,
    )  # fmt: skip
