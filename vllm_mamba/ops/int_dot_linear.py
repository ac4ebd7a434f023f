"""Linear layers with integer dot products: Q8_0 activations, int8 or 4-bit weights.

`quantization="w8a8"` / `"w4a8"` keep the weights of `"int8"` / `"int4"` (the int8 rows with
their float32 scales, `vllm_mamba.ops.int8_linear`; the 4-bit groups of 32 with float16 scales,
`vllm_mamba.ops.int4_linear`), `"w4a8_k"` the Q4_K-style 4-bit super-blocks of
`vllm_mamba.ops.q4k` (through `w4a8_linear` too, told apart by their uint8 scales), and quantise
each row of the activations too, as llama.cpp's Q8_0:

    per block of 32 values of a row:  d = max|x| / 127,  q = round_half_even(x / d)  (int8)

(a block of zeros: d = 0, q = 0). A block's products are then exact integers (`sum q_i w_i`,
int32) scaled by `d` (int8 weights: times the row's scale at the end) or by `d * s` (4-bit
weights, `s` the group's scale; Q4_K-style: `d * ds` minus the block's min `dm` times `d * sum
q_i`); only the float sum over the K / 32 blocks rounds. The references compute the same values
in float32 from the dequantised activations (`dequantize_activations_q8`) and weights, and
differ from the kernels only by that rounding.

The weights of these layers are stored in the strip layout (`to_strips`, made at load time by
`pack_w8a8` / `pack_w4a8`): the same shapes and bytes as the plain layouts, permuted so that
each strip of 16 rows holds 4-byte group g of its rows together (`csrc/int_dot.h`): one vector
load then holds a group of 16 rows, multiplied with one broadcast group of x. The references
take that layout too and unpack it (`from_strips`); `strip_rows` reads single rows (a tied
embedding's lookups).

The C++ kernels (`csrc/int_dot.h`, `csrc/int_dot_linear.cpp`: `torch.ops.vllm_mamba.w8a8_linear`
/ `w4a8_linear`; from 16 rows a cache-blocked GEMM, `csrc/int_dot_gemm.h`) add each row's block
terms in one fixed order whatever the number of rows, so a row's result does not depend on the
batch, bit for bit; K must be a multiple of 32 (`int_dot_supported`). They multiply with
AVX512-VNNI / AVX-VNNI where the CPU has it, unless `VLLM_MAMBA_INT_DOT_VNNI=0` (read once per
process by the kernels), which runs the AVX-512BW / AVX2 kernels instead (`int_dot_instruction`).

Glossary: M rows of x, K input features, N output features, NB = K / 32 blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_mamba.ops import cpu_isa
from vllm_mamba.ops.int4_linear import dequantize_int4
from vllm_mamba.ops.int8_linear import dequantize_int8, kernel_rows
from vllm_mamba.ops.q4k import dequantize_q4k

Q8_BLOCK = 32  # activations sharing one scale
Q8_MAX = 127
STRIP_ROWS = 16  # weight rows per strip of the stored layout
GROUP_BYTES = 4  # bytes of a row kept together in a strip (one vpdpbusd lane)


def to_strips(t: torch.Tensor, group: int) -> torch.Tensor:
    """The strip layout of a plain `t (N, C)` (C a multiple of `group`): rows [16 s, 16 s + L)
    form strip s (L = 16; the last strip the rows left); within it, group g (elements
    [g * group, (g + 1) * group) of a row) of its L rows lie together, row by row. The result has
    t's shape and elements, permuted (a new contiguous tensor)."""
    return _permute_strips(t, group, inverse=False)


def from_strips(t: torch.Tensor, group: int) -> torch.Tensor:
    """The plain `(N, C)` tensor whose strip layout is `t` (the inverse of `to_strips`)."""
    return _permute_strips(t, group, inverse=True)


def _permute_strips(t: torch.Tensor, group: int, inverse: bool) -> torch.Tensor:
    n, c = t.shape
    if c % group:
        raise ValueError(f"strip layout: {c} columns are not whole groups of {group}")
    groups = c // group
    parts = []
    for lo, hi in ((0, n - n % STRIP_ROWS), (n - n % STRIP_ROWS, n)):
        if hi == lo:
            continue
        lanes = min(STRIP_ROWS, hi - lo)
        # plain: (S, L, G, group); stored: (S, G, L, group)
        shape = (-1, groups, lanes, group) if inverse else (-1, lanes, groups, group)
        parts.append(t[lo:hi].reshape(shape).transpose(1, 2).reshape(hi - lo, c))
    return torch.cat(parts).contiguous() if len(parts) > 1 else parts[0].contiguous()


def strip_rows(t: torch.Tensor, rows: torch.Tensor, group: int) -> torch.Tensor:
    """Rows `rows (T,)` of the plain tensor whose strip layout is `t (N, C)` -> `(T, C)`: a
    decode step's few rows as views of their strips (an index of T x C elements cost 75 us a
    row over Qwen3.5's 248k x 1024 head), more rows by one gather."""
    n, c = t.shape
    groups = c // group
    if rows.numel() <= 8 and not rows.is_cuda:
        out = t.new_empty(rows.numel(), c)
        flat = t.reshape(-1)
        for i, r in enumerate(rows.tolist()):
            s0 = r // STRIP_ROWS * STRIP_ROWS
            lanes = min(STRIP_ROWS, n - s0)
            strip = flat[s0 * c : (s0 + lanes) * c].view(groups, lanes, group)  # stored layout
            out[i] = strip[:, r - s0].reshape(c)
        return out
    strip = rows // STRIP_ROWS  # (T,)
    lanes = torch.clamp(n - strip * STRIP_ROWS, max=STRIP_ROWS)  # (T,)
    g = torch.arange(groups, device=t.device)
    lane = rows[:, None] % STRIP_ROWS  # (T, 1)
    start = strip[:, None] * STRIP_ROWS * c + (g * lanes[:, None] + lane) * group  # (T, G)
    index = start[..., None] + torch.arange(group, device=t.device)  # (T, G, group)
    return t.reshape(-1)[index.reshape(-1)].reshape(rows.shape[0], c)


def pack_w8a8(qweight: torch.Tensor) -> torch.Tensor:
    """An int8 weight `(N, K)` in the strip layout the integer-dot kernels read."""
    return to_strips(qweight, GROUP_BYTES)


def pack_w4a8(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 4-bit weight `(N, K/2)` uint8 with its `(N, K/32)` float16 scales (or Q4_K-style
    `(N, S * 16)` uint8 scale bytes, `ops.q4k`) in the strip layout."""
    return to_strips(qweight, GROUP_BYTES), to_strips(scales, 1)


def unpack_w8a8(qweight: torch.Tensor) -> torch.Tensor:
    """The plain `(N, K)` int8 weight of a strip-layout one."""
    return from_strips(qweight, GROUP_BYTES)


def unpack_w4a8(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain 4-bit weight and scales of strip-layout ones."""
    return from_strips(qweight, GROUP_BYTES), from_strips(scales, 1)


def int_dot_supported(k: int) -> bool:
    """Whether a layer with `k` input features can take integer dot products (K % 32 == 0)."""
    return k > 0 and k % Q8_BLOCK == 0


def quantize_activations_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 quantisation of activations, per block of 32 values of the last dimension.

    Args:
        x: `(..., K)` float32 or bfloat16, K a multiple of 32.

    Returns:
        `q (..., K)` int8 codes in [-127, 127] and `d (..., K/32)` float32 block scales
        (`d = max|x| / 127` in float32, `q = round_half_even(x / d)`; 0 for a block of zeros).

    Raises:
        ValueError: K is not a multiple of 32.
    """
    k = x.shape[-1]
    if not int_dot_supported(k):
        raise ValueError(f"quantize_activations_q8: K must be a multiple of 32, got {k}")
    blocks = x.float().reshape(*x.shape[:-1], k // Q8_BLOCK, Q8_BLOCK)  # (..., NB, 32)
    d = blocks.abs().amax(dim=-1) / Q8_MAX  # (..., NB)
    safe = torch.where(d > 0, d, torch.ones_like(d))[..., None]
    q = torch.where(d[..., None] > 0, torch.round(blocks / safe), torch.zeros_like(blocks))
    q = q.clamp_(-Q8_MAX, Q8_MAX).to(torch.int8)  # (..., NB, 32)
    return q.reshape(x.shape), torch.where(d > 0, d, torch.zeros_like(d))


def dequantize_activations_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """`q (..., K)` int8 with `d (..., K/32)` -> the float32 values `q * d` they stand for."""
    k = q.shape[-1]
    blocks = q.float().reshape(*q.shape[:-1], k // Q8_BLOCK, Q8_BLOCK) * d[..., None]
    return blocks.reshape(q.shape)


def fake_quantize_activations_q8(x: torch.Tensor) -> torch.Tensor:
    """`x (..., K)` -> float32 `(..., K)`: x quantised to Q8_0 and back."""
    return dequantize_activations_q8(*quantize_activations_q8(x))


def _q8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`Q8(x) (..., K) @ weight (N, K) float32 ^T + bias` in float32, rounded to x's dtype."""
    xq = fake_quantize_activations_q8(x)  # (..., K) float32
    out = F.linear(xq, weight, None if bias is None else bias.float())
    return out.to(x.dtype)


def w8a8_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`Q8(x) (..., K) @ (qweight * scale)^T + bias` -> `(..., N)` in x's dtype.

    Args:
        x: `(..., K)` float32 or bfloat16 activations, K a multiple of 32.
        qweight: `(N, K)` int8 in the strip layout (`pack_w8a8`).
        scale: `(N,)` float32 per-output-channel scales.
        bias: `(N,)` or None.

    Returns:
        `(..., N)` in the dtype of `x`, computed in float32 and rounded once.
    """
    return _q8_linear(x, dequantize_int8(unpack_w8a8(qweight), scale, torch.float32), bias)


def w4a8_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`Q8(x) (..., K) @ dequantised 4-bit weight^T + bias` -> `(..., N)` in x's dtype.

    Args:
        x: `(..., K)` float32 or bfloat16 activations, K a multiple of 32.
        qweight: `(N, K/2)` uint8, 4-bit weights (`int4_linear`'s codes, or `ops.q4k`'s) in
            the strip layout.
        scales: `(N, K/32)` float16 group scales, or Q4_K-style `(N, ceil(K/256) * 16)` uint8
            scale bytes (`ops.q4k`), in the strip layout (`pack_w4a8`).
        bias: `(N,)` or None.

    Returns:
        `(..., N)` in the dtype of `x`, computed in float32 and rounded once.
    """
    return _q8_linear(x, dequantize_w4a8(qweight, scales), bias)


def dequantize_w4a8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 `(N, K)` weight of a strip-layout 4-bit one (Q4_0- or Q4_K-style)."""
    plain, plain_scales = unpack_w4a8(qweight, scales)
    if plain_scales.dtype == torch.uint8:
        return dequantize_q4k(plain, plain_scales, torch.float32)
    return dequantize_int4(plain, plain_scales, torch.float32)


def w8a8_linear_cpp(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The C++ kernel for `(M, K)` CPU inputs in float32 or bfloat16; the reference otherwise.
    Same signature as `w8a8_linear_ref`."""
    if kernel_rows(x):
        return torch.ops.vllm_mamba.w8a8_linear(x, qweight, scale, bias)
    return w8a8_linear_ref(x, qweight, scale, bias)


def w4a8_linear_cpp(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The C++ kernel for `(M, K)` CPU inputs in float32 or bfloat16; the reference otherwise.
    Same signature as `w4a8_linear_ref`."""
    if kernel_rows(x):
        return torch.ops.vllm_mamba.w4a8_linear(x, qweight, scales, bias)
    return w4a8_linear_ref(x, qweight, scales, bias)


def has_int_dot_kernels() -> bool:
    """Whether the C++ extension is loaded and registers `w8a8_linear` and `w4a8_linear`."""
    return cpu_isa.has_op("w8a8_linear") and cpu_isa.has_op("w4a8_linear")


def int_dot_instruction() -> str:
    """The multiply instruction of the loaded kernels on this CPU: "vpdpbusd" (AVX512-VNNI /
    AVX-VNNI), "maddubs" (AVX-512BW / AVX2 without VNNI), "scalar" (generic build), or "none"
    without the extension."""
    if not cpu_isa.has_op("int_dot_instruction"):
        return "none"
    return str(torch.ops.vllm_mamba.int_dot_instruction())
