"""Weight-only int8 linear layers: the per-channel quantiser, the op, and its `_ref` twin.

A float weight `W (N, K)` becomes `qweight (N, K)` int8 and `scale (N,)` float32 with
`W ~ qweight * scale[:, None]`: symmetric, one scale per output channel, `scale = max|W_n| / 127`
(round to nearest, clamped to [-127, 127]). Activations stay float32 or bfloat16 and products
accumulate in float32, so the only error against the float model is the weight rounding
(at most half a step, `scale / 2`, per weight).

`int8_linear_ref` dequantises and calls `F.linear`; the C++ kernel (`csrc/int8_linear.cpp`)
streams the int8 weight instead and is what `int8_linear_cpp` returns when the extension has
it. `vllm_mamba.ops.dispatch` puts one of them in the ops table.

Glossary: M rows of x, K input features, N output features (channels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_mamba.ops import cpu_isa

INT8_MAX = 127
QUANTIZE_BLOCK = 1 << 22  # float values a quantiser widens at once (16 MiB)


def quantize_int8(
    weight: torch.Tensor, absmax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantisation of a float weight.

    Rows are independent, so a large weight goes in blocks of rows (`QUANTIZE_BLOCK` values):
    the float32 temporaries stay small (quantising a 1 GiB LM head used to hold three float32
    copies of it at once).

    Args:
        weight: `(N, K)` float32 or bfloat16.
        absmax: `(N,)` the largest `|w|` of each row when `weight` is a slice of the rows'
            columns (a row-parallel shard); default: `weight`'s own.

    Returns:
        `qweight (N, K)` int8 (contiguous) and `scale (N,)` float32; an all-zero row gets
        scale 1 and zeros.
    """
    n, k = weight.shape
    qweight = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    step = max(1, QUANTIZE_BLOCK // max(k, 1))
    for r in range(0, n, step):
        w = weight[r : r + step].detach().float()  # (n', K)
        peak = w.abs().amax(dim=1) if absmax is None else absmax[r : r + step].float()
        s = torch.where(peak > 0, peak / INT8_MAX, torch.ones_like(peak))  # (n',)
        qweight[r : r + step] = torch.round(w / s[:, None]).clamp_(-INT8_MAX, INT8_MAX)
        scale[r : r + step] = s
    return qweight, scale


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`qweight (N, K) * scale (N,)` as a float `(N, K)` weight in `dtype`."""
    return (qweight.float() * scale[:, None]).to(dtype)


def int8_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x (..., K) @ (qweight * scale)^T + bias` -> `(..., N)` in x's dtype.

    Args:
        x: `(..., K)` float32 or bfloat16 activations.
        qweight: `(N, K)` int8.
        scale: `(N,)` float32 per-output-channel scales.
        bias: `(N,)` or None.

    Returns:
        `(..., N)` in the dtype of `x`: the float layer with the dequantised weight.
    """
    weight = dequantize_int8(qweight, scale, x.dtype)  # (N, K)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def kernel_rows(x: torch.Tensor) -> bool:
    """Whether the int8 and 4-bit kernels take `x`: `(M, K)` on the CPU, float32 or bfloat16."""
    return x.dim() == 2 and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


def int8_linear_cpp(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The C++ kernel for `(M, K)` CPU inputs in float32 or bfloat16; the reference otherwise.

    Up to a few rows (decode) it streams each int8 weight row once (the float32 products of
    widened weights, scaled at the end); more rows run the same tiled kernel (float32) or
    dequantise blocks of the weight for the dense bfloat16 GEMM. On a CPU with AMX, float32
    calls of 32 to 256 rows (and at least K / 64) run on the bfloat16 tile units instead of the
    tiled kernel, each activation split into three exact bfloat16 parts (`has_amx_int8_path`).
    Same signature as `int8_linear_ref`.
    """
    if kernel_rows(x):
        return torch.ops.vllm_mamba.int8_linear(x, qweight, scale, bias)
    return int8_linear_ref(x, qweight, scale, bias)


def has_amx_int8_path() -> bool:
    """Whether float32 `int8_linear` calls of 32-256 rows run on AMX tiles (`csrc/amx_int8_gemm.h`):
    the AVX-512 build on a CPU with AMX, unless `VLLM_MAMBA_AMX=0`."""
    return has_int8_kernel() and bool(torch.ops.vllm_mamba.amx_int8())


def has_int8_kernel() -> bool:
    """Whether the C++ extension is loaded and registers `int8_linear`."""
    return cpu_isa.has_op("int8_linear")
