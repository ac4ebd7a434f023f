"""`Linear`: an `nn.Linear` whose product runs through the ops table's `linear`.

The table (`vllm_mamba.ops.dispatch`) decides the kernel: on the CPU with the C++ extension,
a matrix-vector kernel for decode-sized batches; `F.linear` otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.ops.table import MambaOps


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and checkpoint names) calling `ops.linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: MambaOps) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.linear_op = ops.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, in_features)` -> `(T, out_features)`."""
        return self.linear_op(x, self.weight, self.bias)
