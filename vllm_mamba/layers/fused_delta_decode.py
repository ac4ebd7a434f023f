"""The fused decode step of the delta-rule mixers, planned once per layer: the Gated DeltaNet
(Qwen3.5 / 3.6, Qwen3-Next, OLMo Hybrid; `plan_gdn`) and Kimi Delta Attention (Kimi Linear;
`plan_kda`).

`plan_gdn` decides at plan time (`layers.decode_plan`) whether a GDN mixer's decode-only steps
run in one call of its backend's `gated_delta.decode_layer` op (C++: `fused_gdn_decode`,
`csrc/fused_decode_gdn.cpp`; the reference `ops.gated_delta.fused_gdn_decode_ref`), with the
block's norm and residual when given one, and builds the call's parameter list once
(`ops.gated_delta.gdn_decode_params`). The mixer names its input projections in the order of
their outputs `[q | k | v | z | b | a]` (`GatedDeltaNet.FUSED_INPUTS`): Qwen3.5's four,
Qwen3-Next's two (after their reorder at load), OLMo Hybrid's six; the kernel streams them all
in one parallel region.

It returns None, and the layer runs unfused (which is the definition), where the kernel does
not apply: no `decode_layer` op of the backend, a mixer that declares `fused_decode = False` or
names no projections, a block norm that is neither `RMSNorm` nor `ZeroCenteredRMSNorm` (the
kernel takes the norm's effective float32 weight: `w`, or `1 + w` for the zero-centred norm),
projections that are not plain `Linear`s without bias (float32 / bfloat16 weights of one model
dtype, int8 or 4-bit: `fused_decode_layer.plain_weight`; tensor-parallel layers are
`Column/RowParallelLinear`s, so they run unfused, as Mamba2's: the row-parallel output needs
its all-reduce), projections that disagree on integer dot products, or states other than
float32 / bfloat16. Per step the plan asks only whether the step is decode-only, at any row
count, speculative chains of up to `CHAIN_MAX_ROWS` rows included (`decode_plan.decode_only`).
Where the backend also has `gated_delta.chain_replay` (and `VLLM_MAMBA_CHAIN_LOG` is not 0),
the plan gives the mixer a `ChainLog` (`layers.chain_log`) and its chains are logged: the
kernel writes no position's state (the sequence's slot keeps the start state, the chain's
first spare slot gets a copy of it) and a record per position, and the step's rollback replays
the kept positions' records.

`plan_kda` does the same for a `KimiDeltaAttention` with its backend's `kda.decode_layer` op
(C++: `fused_kda_decode`, `csrc/fused_decode_kda.cpp`; the reference
`ops.kda.fused_kda_decode_ref`): its first-stage projections in the order of their outputs
`[q | k | v | f_a | g_a | b]` (`FUSED_INPUTS`), the gates' second stages `f_b_proj` and
`g_b_proj` (`FUSED_GATES`), under the same conditions, with the mixer's forget gate
(`lower_bound`: 0 for Kimi's softplus gate, negative for the safe gate). A mixer with
single-stage gates (Ling 3's full-rank `f_proj`, `g_proj`) names no second stages
(`FUSED_GATES` empty) and its first-stage outputs are `[q | k | v | a | gate | b]`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_mamba import envs
from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.layers.chain_log import ChainLog
from vllm_mamba.layers.decode_plan import decode_slots
from vllm_mamba.layers.fused_decode_layer import (
    FusedMambaStep,
    _f32,
    _out_dtype,
    _weights,
    norm_weight,
    step_out_dtype,
)
from vllm_mamba.layers.quantization import uses_int_dot
from vllm_mamba.ops import kda
from vllm_mamba.ops.families import own_op
from vllm_mamba.ops.gated_delta import FAMILY, GdnDecodeParams, gdn_decode_params

_STATE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, eq=False)
class FusedDeltaStep(FusedMambaStep):
    """A delta-rule mixer's decode-only step in one call of `op` (see `FusedMambaStep`), over
    the mixer's `conv` and `recurrent` states; `args` are the block norm's and the gated norm's
    epsilons (then GDN's `beta_scale`); `int_dot`: the integer weights multiply int8-quantised
    activations; `kwargs`: the op's keyword arguments after those (KDA's `lower_bound`)."""

    int_dot: bool = False
    kwargs: Mapping[str, float] = field(default_factory=dict)
    log: ChainLog | None = None

    def __call__(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)` as the unfused block (or mixer) returns it; the mixer's
        bound states advanced in place (a step of speculative chains logs their recurrent
        states when the plan has a `log`)."""
        out_dtype = step_out_dtype(self.out_dtype, self.dtype, hidden)
        state = self.mixer.state
        dst, src = decode_slots(meta)
        kwargs = dict(self.kwargs)
        if self.log is not None and src is not None:
            kwargs["chain_log"] = self.log.buffer(state[self.log.state])
            self.log.active = True
        return self.op(
            hidden, self.params, state["conv"], state["recurrent"], dst, *self.args, out_dtype,
            src, self.int_dot, **kwargs,
        )  # fmt: skip


def _states_apply(mixer: nn.Module) -> bool:
    """Bound `conv` and `recurrent` states, float32 or bfloat16 each."""
    state = mixer.state
    return bool(state) and all(state[n].dtype in _STATE_DTYPES for n in ("conv", "recurrent"))


@dataclass(frozen=True)
class _Planned:
    """What every delta-rule plan needs: the op, the block norm's float32 weight (None without
    a norm), the named projections' `{name}_w` / `{name}_scale` tensors and model dtype, the
    integer-dot mode."""

    op: object
    norm_w: torch.Tensor | None
    weights: dict[str, torch.Tensor | None]
    dtype: torch.dtype
    int_dot: bool


def _plan_parts(
    mixer: nn.Module, family: str, names: tuple[str, ...], norm: nn.Module | None
) -> _Planned | None:
    """The family's `decode_layer` op and the mixer's parts for it, or None where the kernel
    does not apply (see the module)."""
    op = own_op(family, mixer.ops.name, "decode_layer")
    if op is None or not mixer.fused_decode or not _states_apply(mixer):
        return None
    norm_w = None
    if norm is not None:
        norm_w = norm_weight(norm)
        if norm_w is None:
            return None
    if any(getattr(mixer, n).bias is not None for n in names) or mixer.conv_weight.numel() == 0:
        return None
    found = _weights(mixer, names)
    int_dot = {uses_int_dot(getattr(mixer, n)) for n in names}
    if found is None or len(int_dot) != 1:
        return None
    return _Planned(op, norm_w, found[0], found[1], int_dot.pop())


def _step(
    mixer: nn.Module,
    parts: _Planned,
    fixed: tuple,
    inputs: tuple[str, ...],
    args: tuple[float, ...],
    norm: nn.Module | None,
    residual_in_fp32: bool,
    kwargs: Mapping[str, float] | None = None,
) -> FusedDeltaStep:
    """The step calling `parts.op` with `fixed` then the input projections' (weight, scale)
    pairs; `args` the op's constants after the block norm's epsilon, `kwargs` its keyword
    arguments."""
    w = parts.weights
    params = gdn_decode_params(fixed, [(w[f"{n}_w"], w[f"{n}_scale"]) for n in inputs])
    norm_eps = norm.variance_epsilon if norm is not None else 0.0
    out_dtype = _out_dtype(parts.dtype, norm, residual_in_fp32)
    return FusedDeltaStep(
        parts.op, mixer, params, (norm_eps, *args), parts.dtype, out_dtype, None, parts.int_dot,
        dict(kwargs or {}),
    )  # fmt: skip


def plan_gdn(
    mixer: nn.Module, norm: nn.Module | None, residual_in_fp32: bool
) -> FusedDeltaStep | None:
    """A `GatedDeltaNet`'s fused decode step, or None where the kernel does not apply.

    Args:
        mixer: the mixer (its gated norm a `HeadGatedRMSNorm`, checked by the mixer), its
            weights final and its state bound.
        norm: the block's pre-norm; given, the step computes `residual + mixer(norm(hidden))`,
            else `mixer(hidden)`.
        residual_in_fp32: the block keeps its residual stream in float32.
    """
    inputs = tuple(mixer.FUSED_INPUTS)
    parts = _plan_parts(mixer, FAMILY, (*inputs, mixer.OUT), norm) if inputs else None
    if parts is None:
        return None
    w, gate = parts.weights, getattr(mixer, mixer.NORM)
    fixed = GdnDecodeParams(
        norm_w=parts.norm_w, conv_w=_f32(mixer.conv_weight), A_log=_f32(mixer.A_log),
        dt_bias=_f32(mixer.dt_bias), gate_norm_w=_f32(gate.weight),
        out_proj_w=w[f"{mixer.OUT}_w"], out_proj_scale=w[f"{mixer.OUT}_scale"],
    )  # fmt: skip
    args = (gate.variance_epsilon, mixer.beta_scale)
    step = _step(mixer, parts, fixed, inputs, args, norm, residual_in_fp32)
    replay = own_op(FAMILY, mixer.ops.name, "chain_replay")
    if replay is None or not envs.VLLM_MAMBA_CHAIN_LOG:
        mixer.chain_log = None
        return step
    rec = mixer.state["recurrent"]  # (S, Hv, Dk, Dv)
    mixer.chain_log = ChainLog("recurrent", (rec.shape[1], rec.shape[2] + rec.shape[3] + 1), replay)
    return dataclasses.replace(step, log=mixer.chain_log)


def plan_kda(
    mixer: nn.Module, norm: nn.Module | None, residual_in_fp32: bool
) -> FusedDeltaStep | None:
    """A `KimiDeltaAttention`'s fused decode step, or None where the kernel does not apply.

    Args: as `plan_gdn` (the mixer's output norm the sigmoid-gated `kda.norm_gate`); the
    step passes the mixer's `lower_bound` (its forget gate; 0 for Kimi's). The mixer's
    `FUSED_GATES` name the gates' second stages `(f_b, g_b)`, or are empty for single-stage
    gates (the first stage gives the forget gate's input and the output gate themselves).
    """
    inputs, second = tuple(mixer.FUSED_INPUTS), tuple(mixer.FUSED_GATES)
    if not inputs or len(second) not in (0, 2):
        return None
    parts = _plan_parts(mixer, kda.FAMILY, (*inputs, *second, mixer.OUT), norm)
    if parts is None:
        return None
    w, gate = parts.weights, getattr(mixer, mixer.NORM)
    gates = dict.fromkeys(("f_b_w", "f_b_scale", "g_b_w", "g_b_scale"))
    if second:
        f_b, g_b = second
        gates = {
            "f_b_w": w[f"{f_b}_w"], "f_b_scale": w[f"{f_b}_scale"],
            "g_b_w": w[f"{g_b}_w"], "g_b_scale": w[f"{g_b}_scale"],
        }  # fmt: skip
    fixed = kda.KdaDecodeParams(
        norm_w=parts.norm_w, conv_w=_f32(mixer.conv_weight), A_log=_f32(mixer.A_log.reshape(-1)),
        dt_bias=_f32(mixer.dt_bias), gate_norm_w=_f32(gate.weight),
        out_proj_w=w[f"{mixer.OUT}_w"], out_proj_scale=w[f"{mixer.OUT}_scale"], **gates,
    )  # fmt: skip
    kwargs = {"lower_bound": float(mixer.lower_bound)}
    return _step(
        mixer, parts, fixed, inputs, (gate.variance_epsilon,), norm, residual_in_fp32, kwargs
    )
