"""The `linear` op family: every projection of the layers, float, int8 and 4-bit weights.

`linear` is `F.linear` by default (the C++ backend's picks a kernel by shape, dtype and CPU:
`vllm_mamba.ops.cpu_kernels.linear`); `int8_linear` and `int4_linear` run once a weight is
quantised (`vllm_mamba.ops.int8_linear`, `vllm_mamba.ops.int4_linear`: the quantisers, the
references and the C++ kernels' wrappers); `grouped_linear` runs the integer weights that a
pre-quantised checkpoint ships (`vllm_mamba.ops.grouped_linear`); `w8a8_linear` and
`w4a8_linear` multiply the int8 / 4-bit weights with activations quantised to int8 blocks
(`quantization="w8a8"` / `"w4a8"`: `vllm_mamba.ops.int_dot_linear`); `block_linear` multiplies
by a block-diagonal weight stored as its `(G, N, K)` blocks (RecurrentGemma's gates).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from vllm_mamba.ops.families import OpFamily, OpSpec
from vllm_mamba.ops.grouped_linear import grouped_linear_ref
from vllm_mamba.ops.int4_linear import int4_linear_ref
from vllm_mamba.ops.int8_linear import int8_linear_ref
from vllm_mamba.ops.int_dot_linear import w4a8_linear_ref, w8a8_linear_ref

Tensor = torch.Tensor


class LinearOp(Protocol):
    """`x (..., K) @ weight (N, K)^T + bias` -> `(..., N)` (called positionally: the reference
    is `F.linear`, whose first parameter is `input`)."""

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None, /) -> Tensor: ...


class BlockLinearOp(Protocol):
    """See `block_linear_ref`: a block-diagonal `weight (G, N, K)` over `x (T, G K)`."""

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None, /) -> Tensor: ...


def block_linear_ref(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Group g of `x (T, G K)` (columns `[g K, (g + 1) K)`) times `weight[g] (N, K)^T` plus
    `bias[g]` (`bias (G, N)`) -> `(T, G N)`, the groups side by side."""
    groups, n, k = weight.shape
    rows = x.shape[0]
    per_group = x.view(rows, groups, k).transpose(0, 1)  # (G, T, K)
    if bias is None:
        out = torch.bmm(per_group, weight.transpose(1, 2))
    else:
        out = torch.baddbmm(bias.view(groups, 1, n), per_group, weight.transpose(1, 2))
    return out.transpose(0, 1).reshape(rows, groups * n)  # (T, G N)


class Int8LinearOp(Protocol):
    """See `int8_linear_ref`: `x (..., K) @ (qweight (N, K) * scale (N,))^T + bias`."""

    def __call__(
        self, x: Tensor, qweight: Tensor, scale: Tensor, bias: Tensor | None
    ) -> Tensor: ...


class Int4LinearOp(Protocol):
    """See `int4_linear_ref`: `qweight (N, K/2)` uint8 nibbles, `scales (N, K/32)` float16."""

    def __call__(
        self, x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None
    ) -> Tensor: ...


class GroupedLinearOp(Protocol):
    """See `grouped_linear_ref`: integer codes in groups with float32 scales and offsets."""

    def __call__(
        self,
        x: Tensor,
        codes: Tensor,
        scales: Tensor,
        offsets: Tensor | None,
        bias: Tensor | None,
        bits: int,
        group: int,
    ) -> Tensor: ...


# The family's ops (`vllm_mamba.ops.families`): each op's signature and reference.
OPS = OpFamily(
    "linear",
    {
        "linear": OpSpec(LinearOp, F.linear),
        "block_linear": OpSpec(BlockLinearOp, block_linear_ref),
        "int8_linear": OpSpec(Int8LinearOp, int8_linear_ref),
        "int4_linear": OpSpec(Int4LinearOp, int4_linear_ref),
        "grouped_linear": OpSpec(GroupedLinearOp, grouped_linear_ref),
        "w8a8_linear": OpSpec(Int8LinearOp, w8a8_linear_ref),
        "w4a8_linear": OpSpec(Int4LinearOp, w4a8_linear_ref),
    },
)
