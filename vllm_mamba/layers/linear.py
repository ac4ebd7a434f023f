"""`Linear`: an `nn.Linear` whose product runs through the ops table's `linear`.

The table (`vllm_mamba.ops.dispatch`) decides the kernel: on the CPU with the C++ extension,
a matrix-vector kernel for decode-sized batches; `F.linear` otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.ops.table import MambaOps


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and checkpoint names) calling `ops.linear`.

    `vllm_mamba.layers.quantization` may make the weight int8 or 4-bit after loading: it then
    sets `activation_dtype` (the float dtype of the inputs) and a `linear_op` calling
    `int8_linear` or `int4_linear`.
    """

    activation_dtype: torch.dtype | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: MambaOps) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.linear_op = ops.linear

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of this layer's inputs and outputs: the weight's, or the float dtype of a
        quantised weight."""
        return self.activation_dtype or self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, in_features)` -> `(T, out_features)`."""
        return self.linear_op(x, self.weight, self.bias)
