"""The sampler's kernels as one op family, `sampling`: `argmax_rows`, each row's greedy token.

The reference is `torch.argmax` over the last dimension (the first index of the largest value,
the first NaN where a row has one); the C++ op (`csrc/argmax.cpp`) gives the same indices in
one vectorised pass per row, with the rows (or the parts of one row) split over the threads:
11 us a row of a 248k vocabulary on a Zen 5 where torch's reduction took 150 us.

Glossary: R rows, V vocabulary.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from vllm_mamba.ops.families import OpFamily, OpSpec

FAMILY = "sampling"


def argmax_rows_ref(x: Tensor) -> Tensor:
    """`x (R, V)` float32 -> `(R,)` int64: each row's first index of its largest value."""
    return torch.argmax(x, dim=-1)


class ArgmaxRowsOp(Protocol):
    def __call__(self, x: Tensor) -> Tensor: ...


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(FAMILY, {"argmax_rows": OpSpec(ArgmaxRowsOp, argmax_rows_ref)})
