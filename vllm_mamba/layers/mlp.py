"""The dense feed-forward blocks of every model: gated (`GatedMLP`) and plain (`MLP`).

- `GatedMLP`: `down(act(gate(x) * gm) * up(x)) * dm` with separate `gate_proj` / `up_proj`
  (Bamba, Jamba, Falcon-H1 with its muP multipliers `gm`, `dm`), or one merged projection
  whose halves are the gate and up parts (`merged=("input_linear", "output_linear")`:
  Granite 4.0-H's shared expert).
- `MLP`: `down(act(up(x)))` (Nemotron-H's squared ReLU).

With tensor parallelism the input projections are column-parallel and the output projection
row-parallel; `reduce=False` leaves the all-reduce to the caller (the experts of an MoE, summed
once per layer).

Glossary: T tokens, H hidden size, F feed-forward size (this rank's).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.parallel_linear import column_linear, row_linear
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
        y = down(self.act(gate) * up)
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
        self.act = activation(act)
        self.up_proj = column_linear(hidden_size, [ffn_size], bias, ops, tp)
        self.down_proj = row_linear(ffn_size, hidden_size, bias, ops, tp, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`."""
        return self.down_proj(self.act(self.up_proj(x)))
