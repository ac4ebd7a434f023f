"""The fused decode steps of the Mamba and Mamba2 mixers, planned once per layer.

`plan_mamba` / `plan_mamba2` decide at plan time (`layers.decode_plan`) whether a mixer's
decode-only steps run in one call of the ops table's `fused_mamba_decode` /
`fused_mamba2_decode` (`vllm_mamba.ops.fused_decode`), with the block's RMSNorm and residual
when given its norm, and build the call's parameter list once (`MambaParams`, `Mamba2Params`,
by name). They return None, and the layer runs unfused (which is the definition), where the
kernel does not apply: no kernel in the table, a mixer that declares `fused_decode = False` (a
subclass that changes the math: Jamba's normed dt/B/C, Falcon-H1's multipliers), a block norm
that is not a plain `RMSNorm`, projections that are not plain `Linear`s with float32 /
bfloat16 weights of the model dtype, int8 weights with per-row scales (`quantization="int8"`)
or 4-bit weights with group scales (`quantization="int4"`; tensor-parallel layers are not), or
states other than float32 / bfloat16. Integer weights that take integer dot products
(`quantization="w8a8"` / `"w4a8"`, `quantization.uses_int_dot`) run the kernel's `int_dot` mode
when all of the layer's integer projections do (`layer_int_dot`); a layer that mixes both kinds
runs unfused. Per step the plan's `FusedMambaStep.takes` asks only
whether the step is decode-only (`decode_plan.decode_only`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.layers.cache_layers import LayerState
from vllm_mamba.layers.decode_plan import (
    CHAIN_MAX_ROWS,
    MAMBA_MAX_ROWS,
    decode_only,
    decode_slots,
)
from vllm_mamba.layers.layernorm import GatedRMSNorm, RMSNorm, ZeroCenteredRMSNorm
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.quantization import is_int4_linear, is_int8_linear, uses_int_dot
from vllm_mamba.ops.fused_decode import Mamba2Params, MambaParams

Params = list[torch.Tensor | None]
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


def norm_weight(norm: nn.Module) -> torch.Tensor | None:
    """The float32 weight a fused kernel multiplies by after normalising (`w * x / rms(x)`):
    a plain `RMSNorm`'s weight, a `ZeroCenteredRMSNorm`'s `1 + weight` (as it computes in
    float32); None for any other norm."""
    if type(norm) is RMSNorm:
        return _f32(norm.weight)
    if type(norm) is ZeroCenteredRMSNorm:
        return (1.0 + norm.weight.detach().float()).contiguous()
    return None


def _weights(
    mixer: nn.Module, names: tuple[str, ...]
) -> tuple[dict[str, torch.Tensor | None], torch.dtype] | None:
    """The named projections' `{name}_w` weights and `{name}_scale` scales and their one model
    dtype, or None."""
    found = {n: plain_weight(getattr(mixer, n), mixer.ops.linear) for n in names}
    if any(f is None for f in found.values()) or len({f[2] for f in found.values()}) != 1:
        return None
    named: dict[str, torch.Tensor | None] = {}
    for n, (weight, scale, _) in found.items():
        named[f"{n}_w"], named[f"{n}_scale"] = weight, scale
    return named, found[names[0]][2]


def layer_int_dot(linears: list[nn.Module]) -> bool | None:
    """The `int_dot` argument of a fused layer call over these projections: True when every int8
    / 4-bit one takes integer dot products (`uses_int_dot`), False when none does (float
    projections count for neither), None when they differ (the kernel takes one mode per call:
    the layer then runs unfused)."""
    modes = {uses_int_dot(lin) for lin in linears if is_int8_linear(lin) or is_int4_linear(lin)}
    if len(modes) > 1:
        return None
    return modes.pop() if modes else False


def _states_apply(state: LayerState) -> bool:
    """Bound states the kernels read: float32 or bfloat16 each (any `ssm_state_dtype` but
    float16)."""
    return bool(state) and all(state[n].dtype in _FLOAT_DTYPES for n in ("conv", "ssm"))


def _planned(mixer: nn.Module, op: object, norm: nn.Module | None) -> bool:
    """What both mixers' plans need: the kernel, a mixer whose math it computes, a plain
    `RMSNorm` (when fused with the block) and states it reads."""
    return (
        op is not None
        and mixer.fused_decode
        and (norm is None or type(norm) is RMSNorm)
        and _states_apply(mixer.state)
    )


@dataclass(frozen=True, eq=False)
class FusedMambaStep:
    """A Mamba (`kind` "mamba") or Mamba2 ("mamba2") mixer's decode-only step in one call of
    `op`, with the block's norm and residual when planned with one (`block`).

    `params` is the kernel's list (built once); `args` its constant arguments between the
    slots and the result dtype (Mamba: norm and mixer epsilons; Mamba2: groups, group size,
    norm and gate epsilons); `int_dot` the kernel's integer-dot mode (`layer_int_dot`). The
    result dtype is `out_dtype`, or, for a block in a model dtype
    `dtype` other than float32 without a float32 residual, float32 for a float32 input (as
    `residual + mixed` promotes) and `dtype` otherwise.
    """

    op: Callable[..., torch.Tensor]
    mixer: nn.Module
    params: Params
    args: tuple[float | int, ...]
    dtype: torch.dtype
    out_dtype: torch.dtype | None
    max_rows: int | None
    int_dot: bool = False
    # Mamba2 blocks: the residual multiplier (keyword-only: subclasses add positional fields)
    residual_scale: float = field(default=1.0, kw_only=True)

    def takes(self, hidden: torch.Tensor, meta: MambaMetadata) -> bool:
        """A decode-only step (see `decode_plan.decode_only`)."""
        return decode_only(hidden, meta, self.max_rows, CHAIN_MAX_ROWS)

    def __call__(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)` as the unfused block (or mixer) returns it; the mixer's
        bound states advanced in place."""
        out_dtype = step_out_dtype(self.out_dtype, self.dtype, hidden)
        state = self.mixer.state
        dst, src = decode_slots(meta)
        scale = () if self.residual_scale == 1.0 else (self.residual_scale,)
        return self.op(
            hidden, self.params, state["conv"], state["ssm"], dst, *self.args, out_dtype, src,
            self.int_dot, *scale,
        )  # fmt: skip


def step_out_dtype(
    fixed: torch.dtype | None, dtype: torch.dtype, hidden: torch.Tensor
) -> torch.dtype:
    """A fused step's result dtype: `fixed` where the plan fixed it (`_out_dtype`), else float32
    for a float32 input (as `residual + mixed` promotes) and the model dtype `dtype` otherwise."""
    if fixed is not None:
        return fixed
    return torch.float32 if hidden.dtype == torch.float32 else dtype


def _out_dtype(dtype: torch.dtype, norm: nn.Module | None, fp32: bool) -> torch.dtype | None:
    """The unfused path's result dtype where fixed: the mixer returns the model dtype `dtype`,
    the block with a float32 residual (`fp32`) float32; None: it follows the input's."""
    if norm is None:
        return dtype
    if fp32 or dtype == torch.float32:
        return torch.float32
    return None


def plan_mamba(
    mixer: nn.Module, norm: nn.Module | None, residual_in_fp32: bool
) -> FusedMambaStep | None:
    """A `MambaMixer`'s fused decode step, or None where the kernel does not apply.

    Args:
        mixer: the mixer, its weights final and its state bound.
        norm: the block's pre-norm; given, the step computes `residual + mixer(norm(hidden))`,
            else `mixer(hidden)`.
        residual_in_fp32: the block keeps its residual stream in float32.
    """
    op = mixer.ops.fused_mamba_decode
    if not _planned(mixer, op, norm):
        return None
    names = ("in_proj", "x_proj", "dt_proj", "out_proj")
    found = _weights(mixer, names)
    int_dot = layer_int_dot([getattr(mixer, n) for n in names])
    if found is None or int_dot is None:
        return None
    weights, dtype = found
    params = MambaParams(
        norm_w=_f32(norm.weight) if norm is not None else None,
        in_proj_b=_f32(mixer.in_proj.bias), conv_w=_f32(mixer.conv_weight),
        conv_b=_f32(mixer.conv1d.bias), dt_proj_b=_f32(mixer.dt_proj.bias),
        A=mixer.A.contiguous(), D=_f32(mixer.D), out_proj_b=_f32(mixer.out_proj.bias), **weights,
    )  # fmt: skip
    norm_eps = norm.variance_epsilon if norm is not None else 0.0
    mixer_eps = -1.0 if mixer.mixer_rms_eps is None else float(mixer.mixer_rms_eps)
    return FusedMambaStep(
        op, mixer, list(params), (norm_eps, mixer_eps), dtype,
        _out_dtype(dtype, norm, residual_in_fp32), MAMBA_MAX_ROWS, int_dot,
    )  # fmt: skip


def plan_mamba2(
    mixer: nn.Module, norm: nn.Module | None, residual_in_fp32: bool, residual_scale: float = 1.0
) -> FusedMambaStep | None:
    """A `Mamba2Mixer`'s fused decode step, or None where the kernel does not apply.

    Args: as `plan_mamba`; `residual_scale` the layer's residual multiplier (with `norm`).
    """
    op = mixer.ops.fused_mamba2_decode
    if not _planned(mixer, op, norm) or type(mixer.norm) is not GatedRMSNorm:
        return None
    found = _weights(mixer, ("in_proj", "out_proj"))
    int_dot = layer_int_dot([mixer.in_proj, mixer.out_proj])
    if found is None or int_dot is None:
        return None
    weights, dtype = found
    params = Mamba2Params(
        norm_w=_f32(norm.weight) if norm is not None else None,
        in_proj_b=_f32(mixer.in_proj.bias), conv_w=_f32(mixer.conv_weight),
        conv_b=_f32(mixer.conv1d.bias), dt_bias=_f32(mixer.dt_bias), A=mixer.A.contiguous(),
        D=_f32(mixer.D), gate_norm_w=_f32(mixer.norm.weight),
        out_proj_b=_f32(mixer.out_proj.bias), **weights,
    )  # fmt: skip
    norm_eps = norm.variance_epsilon if norm is not None else 0.0
    args = (mixer.n_groups, mixer.norm.group_size, norm_eps, mixer.norm.variance_epsilon)
    return FusedMambaStep(
        op, mixer, list(params), args, dtype, _out_dtype(dtype, norm, residual_in_fp32), None,
        int_dot, residual_scale=float(residual_scale) if norm is not None else 1.0,
    )  # fmt: skip
