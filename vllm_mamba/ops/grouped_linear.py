"""Linear layers over pre-quantised weights in groups: the layout, its reference op.

Checkpoints that ship integer weights (GGUF blocks, GPTQ / AWQ, compressed-tensors) store a
weight `W (N, K)` as integer codes with one scale (and often one offset) per group of `G`
consecutive weights of a row. `GroupedWeight` holds that layout without rounding anything:

    W[n, k] = scales[n, k // G] * codes[n, k] + offsets[n, k // G]

- `bits == 8`: `codes (N, K)` int8 (signed, any range that fits: Q8_0's [-127, 127], Q6_K's
  [-32, 31], Q5_K's [0, 31]).
- `bits == 4`: `codes (N, K/2)` uint8 packed as the engine's int4 (`ops/int4_linear.py`): per
  group of 32 columns, byte j holds column j in its low nibble and column j + 16 in its high
  nibble; the codes are the nibbles, unsigned in [0, 15] (Q4_0 is `scale = d`,
  `offset = -8 d`; Q4_1 / Q4_K / GPTQ / AWQ `offset = -scale * zero` or `min`).
- `scales`, `offsets`: `(N, K/G)` float32, so that products of a float16 scale and a small
  integer (Q4_K's `d * sc`, GPTQ's `scale * zero`) stay exact; `offsets` None means zero.
- `G` a multiple of 16 (8-bit) or of 32 (4-bit) that divides K.

`grouped_linear_ref` dequantises and calls `F.linear`; backends register faster kernels under
the `linear` family's `grouped_linear`: the C++ kernel (`csrc/grouped_linear.cpp`, wrapped by
`grouped_linear_cpp`) streams the codes once for a few rows of x and dequantises blocks of the
weight for a dense GEMM above.

Glossary: M rows of x, K input features, N output features, G weights per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_mamba.ops import cpu_isa
from vllm_mamba.ops.int8_linear import kernel_rows

__all__ = [
    "GroupedWeight",
    "grouped_linear_cpp",
    "grouped_linear_ref",
    "has_grouped_kernel",
    "pack_nibbles",
    "unpack_nibbles",
]

NIBBLE_BLOCK = 32  # columns of one packing unit of 4-bit codes (the engine's int4 layout)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes `(N, K)` in [0, 15] (any integer dtype), K a multiple of 32 -> `(N, K/2)` uint8."""
    n, k = codes.shape
    u = codes.to(torch.uint8).reshape(n, k // NIBBLE_BLOCK, NIBBLE_BLOCK)  # (N, K/32, 32)
    return (u[..., :16] | (u[..., 16:] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`(N, K/2)` uint8 -> the codes `(N, K)` uint8 in [0, 15]."""
    n, half = packed.shape
    b = packed.reshape(n, half // 16, 16)  # (N, K/32, 16)
    return torch.cat([b & 0x0F, b >> 4], dim=2).reshape(n, half * 2)


@dataclass
class GroupedWeight:
    """A `(N, K)` weight as integer codes with per-group float32 scales and offsets (see the
    module docstring for the layout)."""

    codes: torch.Tensor  # bits 8: (N, K) int8; bits 4: (N, K/2) uint8 packed nibbles
    scales: torch.Tensor  # (N, K/G) float32
    offsets: torch.Tensor | None  # (N, K/G) float32, or None for zero
    bits: int  # 4 or 8
    group: int  # G
    # A 4-bit weight read from Q4_K blocks: their super-block scale bytes `(N, K/256 * 16)`
    # uint8 in `vllm_mamba.ops.q4k`'s layout (the same d, dmin and 6-bit sc, m), which the
    # integer-dot kernels take with the codes as they are (`quantization="w4a8_k"`); else None.
    super_scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"GroupedWeight.bits must be 4 or 8, got {self.bits}")
        unit = NIBBLE_BLOCK if self.bits == 4 else 16
        n, k = self.shape
        if self.group <= 0 or self.group % unit or k % self.group:
            raise ValueError(
                f"GroupedWeight.group {self.group}: must be a multiple of {unit} dividing K={k}"
            )
        want = (n, k // self.group)
        if tuple(self.scales.shape) != want or (
            self.offsets is not None and tuple(self.offsets.shape) != want
        ):
            raise ValueError(f"GroupedWeight scales / offsets must be {want}")
        if self.super_scales is not None and (
            self.bits != 4
            or self.group != NIBBLE_BLOCK
            or tuple(self.super_scales.shape) != (n, -(-k // 256) * 16)
        ):
            raise ValueError("GroupedWeight.super_scales: 4-bit groups of 32, (N, K/256 * 16)")

    @property
    def shape(self) -> tuple[int, int]:
        """`(N, K)` of the float weight."""
        n, width = self.codes.shape
        return (n, width * 2 if self.bits == 4 else width)

    def code_values(self) -> torch.Tensor:
        """The codes as `(N, K)` integers (int16: wide enough for both layouts)."""
        if self.bits == 4:
            return unpack_nibbles(self.codes).to(torch.int16)
        return self.codes.to(torch.int16)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight `(N, K)` in `dtype` (computed in float32, as the kernels do)."""
        n, k = self.shape
        q = self.code_values().float().reshape(n, k // self.group, self.group)
        w = q * self.scales[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.reshape(n, k).to(dtype)

    def rows(self, index: slice | torch.Tensor) -> GroupedWeight:
        """The weight of the selected rows (a slice or an index tensor), same layout."""
        offsets = None if self.offsets is None else self.offsets[index].contiguous()
        supers = None if self.super_scales is None else self.super_scales[index].contiguous()
        return GroupedWeight(
            self.codes[index].contiguous(),
            self.scales[index].contiguous(),
            offsets,
            self.bits,
            self.group,
            supers,
        )

    @staticmethod
    def cat(parts: Sequence[GroupedWeight]) -> GroupedWeight:
        """The weights stacked along rows (all with the same bits, group and K).

        Raises:
            ValueError: the parts' layouts differ.
        """
        first = parts[0]
        if any(
            (p.bits, p.group, p.shape[1]) != (first.bits, first.group, first.shape[1])
            for p in parts
        ):
            raise ValueError("GroupedWeight.cat: the parts have different layouts")
        with_offsets = any(p.offsets is not None for p in parts)
        offsets = (
            torch.cat(
                [p.offsets if p.offsets is not None else torch.zeros_like(p.scales) for p in parts]
            )
            if with_offsets
            else None
        )
        supers = [p.super_scales for p in parts]
        return GroupedWeight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            offsets,
            first.bits,
            first.group,
            torch.cat(supers) if all(t is not None for t in supers) else None,  # type: ignore[misc]
        )

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and offsets."""
        total = self.codes.nbytes + self.scales.nbytes
        return total + (self.offsets.nbytes if self.offsets is not None else 0)


def grouped_linear_ref(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group: int,
) -> torch.Tensor:
    """`x (..., K) @ W^T + bias` -> `(..., N)` in x's dtype, W the `GroupedWeight` of the
    arguments dequantised in float32 (then cast to x's dtype)."""
    weight = GroupedWeight(codes, scales, offsets, bits, group).dequantize(x.dtype)  # (N, K)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def _kernel_takes(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
) -> bool:
    """Whether `csrc/grouped_linear.cpp` takes these inputs: `(M, K)` float32 or bfloat16 x,
    the codes' dtype of `bits`, float32 scales and offsets, all on the CPU."""
    code_dtype = {4: torch.uint8, 8: torch.int8}.get(bits)
    groups = [scales] if offsets is None else [scales, offsets]
    return (
        kernel_rows(x)
        and codes.dtype == code_dtype
        and codes.device.type == "cpu"
        and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in groups)
    )


def grouped_linear_cpp(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group: int,
) -> torch.Tensor:
    """The C++ kernel for the inputs it takes (`(M, K)` CPU x in float32 or bfloat16, int8 /
    uint8 codes, float32 scales and offsets); the reference otherwise. Same signature as
    `grouped_linear_ref`.

    Up to a few dozen rows it streams the codes once, widening them in registers, and adds
    `scale * dot + offset * sum(x's group)` per group; more rows dequantise blocks of the weight
    for a dense GEMM.

    Raises:
        ValueError: shapes that do not fit the layout (from the kernel, naming the tensor).
    """
    if _kernel_takes(x, codes, scales, offsets, bits):
        return torch.ops.vllm_mamba.grouped_linear(x, codes, scales, offsets, bias, bits, group)
    return grouped_linear_ref(x, codes, scales, offsets, bias, bits, group)


def has_grouped_kernel() -> bool:
    """Whether the C++ extension is loaded and registers `grouped_linear`."""
    return cpu_isa.has_op("grouped_linear")
