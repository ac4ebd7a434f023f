"""Weight-only 4-bit linear layers: the group-wise quantiser, the op, and its `_ref` twin.

A float weight `W (N, K)`, K a multiple of 32, becomes `qweight (N, K/2)` uint8 and
`scales (N, K/32)` float16: each group of 32 consecutive weights of a row has one scale, and
weight `(n, i)` stands for `q * scale[n, i // 32]` with `q` an integer in [-8, 7]. The packing
is `csrc/gemv.h`'s `Q4Rows`: per group, byte j holds weight j in its low nibble and weight
j + 16 in its high nibble, each stored as `q + 8`.

Rounding (llama.cpp's Q4_0 rule): per group, `m` is the weight of largest magnitude (with its
sign), `scale = -m / 8` rounded to float16, and `q = clamp(round(w / scale), -8, 7)` with that
float16 scale. `m` itself is level -8 (exact) and all 16 levels are used; the scale is negative
when `m` is positive. Every weight is within `|scale| / 2` of its value, except weights of
`m`'s opposite sign beyond 7.5 steps, clamped to level 7: within `|scale|`. Measured on the
shipped model's 4-bit layers (relative squared reconstruction error, sum over all weights):
this rule 0.0073; `|m| / 7.5` with q in [-8, 7] (every error within half a step) 0.0089;
`|m| / 8` 0.0087; `|m| / 7` with q in [-7, 7] 0.0094. Held-out loss: benchmarks/README.md.

`int4_linear_ref` dequantises and calls `F.linear`; the C++ kernel (`csrc/int4_linear.cpp`)
unpacks the 4-bit weight in registers instead and is what `int4_linear_cpp` returns when the
extension has it. `vllm_mamba.ops.dispatch` puts one of them in the ops table.

Glossary: M rows of x, K input features, N output features (channels), G = K / 32 groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_mamba.ops import cpu_isa
from vllm_mamba.ops.int8_linear import QUANTIZE_BLOCK, kernel_rows

INT4_GROUP = 32  # weights sharing one scale (gemv.h's kQ4Group)
INT4_MIN, INT4_MAX = -8, 7


def int4_supported(weight: torch.Tensor) -> bool:
    """Whether a `(N, K)` weight can be quantised to 4-bit groups (K a multiple of 32)."""
    return weight.dim() == 2 and weight.shape[1] > 0 and weight.shape[1] % INT4_GROUP == 0


def quantize_int4(
    weight: torch.Tensor, group: int = INT4_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group-wise 4-bit quantisation of a float weight (see the module docstring).

    Args:
        weight: `(N, K)` float32 or bfloat16, K a multiple of `group`.
        group: weights per scale; only 32 (the kernels' layout).

    Returns:
        `qweight (N, K/2)` uint8 (packed) and `scales (N, K/32)` float16 (signed), both
        contiguous; an all-zero group gets scale 1 and zeros.

    Raises:
        ValueError: `group` is not 32, or `weight` is not 2-D with K a multiple of 32.
    """
    if group != INT4_GROUP:
        raise ValueError(f"quantize_int4: group must be {INT4_GROUP}, got {group}")
    if not int4_supported(weight):
        raise ValueError(
            f"quantize_int4: weight must be (N, K) with K a multiple of {INT4_GROUP}, "
            f"got {tuple(weight.shape)}"
        )
    n, k = weight.shape
    packed = torch.empty(n, k // 2, dtype=torch.uint8)
    scales = torch.empty(n, k // group, dtype=torch.float16)
    step = max(1, QUANTIZE_BLOCK // k)  # rows at a time: small float32 temporaries
    for r in range(0, n, step):
        packed[r : r + step], scales[r : r + step] = _quantize_rows(weight[r : r + step], group)
    return packed, scales


def _quantize_rows(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_int4` of a block of rows `(n, K)`: packed `(n, K/2)`, scales `(n, K/32)`."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group, group)  # (n, G, 32)
    peak = w.gather(2, w.abs().argmax(dim=2, keepdim=True)).squeeze(2)  # (n, G) signed max
    scale16 = (peak / INT4_MIN).to(torch.float16)  # (n, G); peak is level -8
    # All-zero groups, and groups so small that the float16 scale underflows: scale 1, q = 0.
    scale16 = torch.where(scale16 != 0, scale16, torch.ones_like(scale16))
    q = torch.round(w / scale16.float()[..., None]).clamp_(INT4_MIN, INT4_MAX)  # (n, G, 32)
    u = (q + 8).to(torch.uint8)  # (n, G, 32), nibbles in [0, 15]
    packed = u[..., :16] | (u[..., 16:] << 4)  # (n, G, 16): byte j = w_j | w_{j+16} << 4
    return packed.reshape(n, k // 2), scale16


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """`qweight (N, K/2)` uint8 -> the integer levels `q (N, K)` int8 in [-8, 7]."""
    n, half = qweight.shape
    b = qweight.reshape(n, half // 16, 16)  # (N, G, 16)
    q = torch.cat([b & 0x0F, b >> 4], dim=2).to(torch.int8) - 8  # (N, G, 32)
    return q.reshape(n, half * 2)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`qweight (N, K/2)` with `scales (N, K/32)` as a float `(N, K)` weight in `dtype`."""
    q = unpack_int4(qweight).float()  # (N, K)
    n, k = q.shape
    w = q.reshape(n, k // INT4_GROUP, INT4_GROUP) * scales.float()[..., None]
    return w.reshape(n, k).to(dtype)


def int4_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x (..., K) @ dequantised weight^T + bias` -> `(..., N)` in x's dtype.

    Args:
        x: `(..., K)` float32 or bfloat16 activations.
        qweight: `(N, K/2)` uint8, packed 4-bit weights.
        scales: `(N, K/32)` float16 group scales.
        bias: `(N,)` or None.

    Returns:
        `(..., N)` in the dtype of `x`: the float layer with the dequantised weight.
    """
    weight = dequantize_int4(qweight, scales, x.dtype)  # (N, K)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def int4_linear_cpp(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The C++ kernel for `(M, K)` CPU inputs in float32 or bfloat16; the reference otherwise.

    Up to a few dozen rows it unpacks each group of 32 weights in registers once for several
    rows of x; more rows dequantise blocks of the weight for a dense GEMM. Same signature as
    `int4_linear_ref`.
    """
    if kernel_rows(x):
        return torch.ops.vllm_mamba.int4_linear(x, qweight, scales, bias)
    return int4_linear_ref(x, qweight, scales, bias)


def has_int4_kernel() -> bool:
    """Whether the C++ extension is loaded and registers `int4_linear`."""
    return cpu_isa.has_op("int4_linear")
