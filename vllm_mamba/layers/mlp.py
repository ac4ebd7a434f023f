"""The dense feed-forward blocks of every model: gated (`GatedMLP`) and plain (`MLP`).

- `GatedMLP`: `down(act(gate(x) * gm) * up(x)) * dm` with separate `gate_proj` / `up_proj`
  (Bamba, Jamba, Falcon-H1 with its muP multipliers `gm`, `dm`), or one merged projection
  whose halves are the gate and up parts (`merged=("input_linear", "output_linear")`:
  Granite 4.0-H's shared expert).
- `MLP`: `down(act(up(x)))` (Nemotron-H's squared ReLU).

With tensor parallelism the input projections are column-parallel and the output projection
row-parallel; `reduce=False` leaves the all-reduce to the caller (the experts of an MoE, summed
once per layer).

Fused decode (`layers.decode_plan`): `plan_mlp` plans a layer's feed-forward stage
`h + rm * GatedMLP(norm(h))` as one call of the `ffn` family's `mlp_decode` op
(`vllm_mamba.ops.ffn`: norm, gate and up products, activation, multipliers, down product and
residual) where the MLP's projections are plain one-rank `Linear`s without biases, float32 /
bfloat16, int8 or 4-bit of one model dtype, its activation one the kernel has, and the norm a
plain or zero-centred `RMSNorm` (`ffn_norm_vector`); `FusedFfnStep` is the planned call (the
MoE's too, `layers.moe.plan_moe`).

Glossary: T tokens, H hidden size, F feed-forward size (this rank's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decode_plan import decode_only
from vllm_mamba.layers.fused_decode_layer import norm_weight, plain_weight
from vllm_mamba.layers.parallel_linear import column_linear, row_linear
from vllm_mamba.layers.quantization import uses_int_dot
from vllm_mamba.layers.rowwise import rowwise
from vllm_mamba.ops import ffn as ffn_ops
from vllm_mamba.ops.families import own_op
from vllm_mamba.ops.table import MambaOps


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU."""
    return F.relu(x).square()


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "relu2": relu2,
}


def activation(name: str, field: str = "hidden_act") -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called `name`.

    Raises:
        ValueError: naming `field` when the activation is not known.
    """
    if name not in ACTIVATIONS:
        raise ValueError(f"{field} {name!r} is not one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """`down(act(gate(x) * gate_multiplier) * up(x)) * down_multiplier`."""

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        bias: bool,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
        *,
        act: str = "silu",
        reduce: bool = True,
        merged: tuple[str, str] | None = None,
        gate_multiplier: float = 1.0,
        down_multiplier: float = 1.0,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.act = activation(act)
        self.gate_multiplier = float(gate_multiplier)
        self.down_multiplier = float(down_multiplier)
        self._merged = merged
        if merged is None:
            self.gate_proj = column_linear(hidden_size, [ffn_size], bias, ops, tp)
            self.up_proj = column_linear(hidden_size, [ffn_size], bias, ops, tp)
            self.down_proj = row_linear(ffn_size, hidden_size, bias, ops, tp, reduce)
        else:
            sections = [ffn_size, ffn_size]
            self.add_module(merged[0], column_linear(hidden_size, sections, bias, ops, tp))
            self.add_module(merged[1], row_linear(ffn_size, hidden_size, bias, ops, tp, reduce))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`."""
        if self._merged is None:
            gate, up, down = self.gate_proj(x), self.up_proj(x), self.down_proj
        else:
            gate, up = getattr(self, self._merged[0])(x).chunk(2, dim=-1)  # (T, F) each
            down = getattr(self, self._merged[1])
        if self.gate_multiplier != 1.0:
            gate = gate * self.gate_multiplier
        y = down(rowwise(self.act, gate) * up)  # each row as alone (a speculative chain's)
        return y if self.down_multiplier == 1.0 else y * self.down_multiplier


class MLP(nn.Module):
    """`down(act(up(x)))`."""

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        bias: bool,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
        *,
        act: str = "relu2",
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.act = activation(act)
        self.up_proj = column_linear(hidden_size, [ffn_size], bias, ops, tp)
        self.down_proj = row_linear(ffn_size, hidden_size, bias, ops, tp, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`."""
        return self.down_proj(rowwise(self.act, self.up_proj(x)))


# ---- fused decode of the feed-forward stage ------------------------------------------------

_ACT_CODES = {id(ACTIVATIONS[name]): code for name, code in ffn_ops.ACT_CODES.items()}
Params = list[torch.Tensor | None]
Projection = tuple[torch.Tensor, torch.Tensor | None]  # a weight and its scale (None: float)


def act_code(fn: Callable[[torch.Tensor], torch.Tensor]) -> int | None:
    """The `ffn` kernels' code of activation `fn` (one of `ACTIVATIONS`), or None."""
    return _ACT_CODES.get(id(fn))


def ffn_norm_vector(norm: nn.Module) -> tuple[torch.Tensor, float] | None:
    """`norm_weight(norm)` and the norm's epsilon; None for a norm the kernels do not compute."""
    weight = norm_weight(norm)
    return None if weight is None else (weight, float(norm.variance_epsilon))


class Projections:
    """Collects a layer's plain projections (`plain_weight`), checking that they share one model
    dtype and one `int_dot` setting; `ok` turns False at the first that does not qualify."""

    def __init__(self, linear_op: object) -> None:
        self.linear_op = linear_op
        self.ok = True
        self.dtypes: set[torch.dtype] = set()
        self.int_dots: set[bool] = set()

    def take(self, linear: nn.Module) -> Projection:
        """`(weight, scale)` of a bias-free plain `Linear` (`(None, None)` after a failure)."""
        found = plain_weight(linear, self.linear_op) if self.ok else None
        if found is None or getattr(linear, "bias", None) is not None:
            self.ok = False
            return None, None  # type: ignore[return-value]
        self.dtypes.add(found[2])
        if found[1] is not None:
            self.int_dots.add(uses_int_dot(linear))
        return found[0], found[1]

    def dtype(self) -> torch.dtype | None:
        """The one model dtype, or None (a failure, or several dtypes / int_dot settings)."""
        if not self.ok or len(self.dtypes) != 1 or len(self.int_dots) > 1:
            return None
        return next(iter(self.dtypes))

    @property
    def int_dot(self) -> bool:
        return True in self.int_dots


def kernel_computes(mlp: nn.Module) -> bool:
    """Whether the `ffn` kernels compute `mlp`'s forward: a `GatedMLP`, or a subclass that
    declares itself so (`kernel_clips`: `layers.clamped_swiglu.ClampedGatedMLP`, whose clip
    the kernels take); other subclasses (softcapped, scaled) are not."""
    return type(mlp) is GatedMLP or bool(type(mlp).__dict__.get("kernel_clips", False))


def swiglu_clip(mlp: nn.Module) -> tuple[float, bool]:
    """A `GatedMLP`'s SwiGLU clip as the `ffn` kernels take it: `(limit, before_act)`, `(0.0,
    False)` for none (`layers.clamped_swiglu.ClampedGatedMLP` has one)."""
    return float(getattr(mlp, "limit", 0.0)), bool(getattr(mlp, "before_act", False))


def gated_projections(mlp: nn.Module, got: Projections) -> tuple[Projection, ...] | None:
    """A `GatedMLP`'s (or a clipped one's: `swiglu_clip`) gate, up (None for a merged
    `[gate | up]`) and down projections through `got`, or None when it has multipliers (see
    `plan_mlp`, which takes them)."""
    if not kernel_computes(mlp):
        return None
    if mlp._merged is None:
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        return got.take(gate), got.take(up), got.take(down)
    merged, down = (getattr(mlp, n) for n in mlp._merged)
    return got.take(merged), (None, None), got.take(down)


@dataclass(frozen=True, eq=False)
class FusedFfnStep:
    """A layer's feed-forward stage `h + rm * ffn(norm(h))` in one call of `op` (the `ffn`
    family's `mlp_decode` or `moe_decode`) for decode-only steps of up to `ffn.MAX_ROWS` rows
    with an input in the model dtype `dtype`; `params` and the constant `args` built once;
    `keep` what the plan keeps alive with it (an MoE's stacked experts). With `max_rows` past
    `MAX_ROWS` (an MoE: `MOE_MAX_ROWS`) a step of up to `max_rows` rows outside speculative
    chains runs as consecutive calls of `MAX_ROWS` rows: a stage's rows are independent, and
    the unfused MoE runs its chosen experts in a Python loop."""

    op: Callable[..., torch.Tensor]
    params: Params
    args: tuple[float | int | bool, ...]
    dtype: torch.dtype
    int_dot: bool
    keep: object = None
    tail: tuple[float | bool, ...] = ()  # the arguments after `int_dot` (residual, clips)
    max_rows: int = ffn_ops.MAX_ROWS

    def takes(self, hidden: torch.Tensor, meta: object) -> bool:
        """A decode-only step (`decode_plan.decode_only`) of at most `max_rows` rows, chains
        of up to `MAX_ROWS` rows included, in the model dtype."""
        return (
            isinstance(meta, MambaMetadata)
            and hidden.dtype == self.dtype
            and decode_only(hidden, meta, self.max_rows, ffn_ops.MAX_ROWS)
        )

    def __call__(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`; a chain's rows each computed as alone (the kernels'
        rows never depend on the batch)."""
        if hidden.shape[0] <= ffn_ops.MAX_ROWS:
            return self._call(hidden)
        return torch.cat([self._call(part) for part in hidden.split(ffn_ops.MAX_ROWS)])

    def _call(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.op(hidden, self.params, *self.args, hidden.dtype, self.int_dot, *self.tail)


def plan_mlp(
    mlp: nn.Module, norm: nn.Module | None, residual_multiplier: float, residual: bool = True
) -> FusedFfnStep | None:
    """`h + rm * mlp(norm(h))` as one `mlp_decode` call, or None where the kernel does not
    apply (see the module docstring). `norm` None: the stage has none; `residual` False: the
    stage's output alone, `rm * mlp(...)` (a stage inside residual streams). A clipped SwiGLU
    (`swiglu_clip`) is clipped in the kernel."""
    if not kernel_computes(mlp):
        return None
    op = own_op("ffn", mlp.ops.name, "mlp_decode")
    normed = (None, 0.0) if norm is None else ffn_norm_vector(norm)
    code = act_code(mlp.act)
    if op is None or normed is None or code is None:
        return None
    got = Projections(mlp.ops.linear)
    found = gated_projections(mlp, got)
    dtype = got.dtype()
    if found is None or dtype is None:
        return None
    (gate_w, gate_s), (up_w, up_s), (down_w, down_s) = found
    params = ffn_ops.MlpParams(normed[0], gate_w, up_w, down_w, gate_s, up_s, down_s)
    args = (normed[1], code, mlp.gate_multiplier, mlp.down_multiplier, float(residual_multiplier))
    tail = (residual, *swiglu_clip(mlp))
    return FusedFfnStep(op, list(params), args, dtype, got.int_dot, tail=tail)
