"""Microscaling float formats: FP4 (E2M1) codes with a scale per small block, as MXFP4
(OCP: blocks of 32, E8M0 power-of-two scales), NVFP4 (blocks of 16, float8 e4m3 scales over
one float32 global scale) and gpt-oss (`quant_method: mxfp4`: `X_blocks` / `X_scales`) store
them; and MXFP8 (float8 e4m3 values over E8M0 scales of 32).

An E2M1 value is one of {0, 0.5, 1, 1.5, 2, 3, 4, 6} with a sign: twice it is an integer in
[-12, 12]. So `W = value * s` is exactly `(2 value) * (s / 2)`: int8 codes with float32
scales per block, which `GroupedWeight` (8-bit, groups of 16 or 32) holds without rounding:
MXFP4 and NVFP4 run in the grouped 8-bit kernel at 9 / 10 bits per weight (float32 scales),
the values the format defines bit for bit. With `quantization="int8"` / `"int4"` they load
as float32 values instead and the load-time quantiser requantises them.

Glossary: N output features, K input features, B values per block.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.layers.packed_weights import attach_packed
from vllm_mamba.models.prequantized.common import gather_layers
from vllm_mamba.ops.grouped_linear import GroupedWeight

__all__ = ["e8m0", "fp4_doubled", "gpt_oss_mxfp4_weights", "scaled_blocks"]

# twice the E2M1 magnitudes of codes 0..7; bit 3 is the sign
_DOUBLED_E2M1 = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12], dtype=torch.int8)


def fp4_doubled(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 pairs `(..., K/2)` uint8 (element 2j in the low nibble, 2j+1 in the high) -> twice
    their values `(..., K)` int8 in [-12, 12]."""
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)  # (..., K)
    magnitude = _DOUBLED_E2M1[(nibbles & 0x07).long()]
    return torch.where(nibbles >= 8, -magnitude, magnitude)


def e8m0(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8, or torch's float8_e8m0fnu) -> `2^(e - 127)` float32."""
    bits = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    return torch.ldexp(torch.ones(bits.shape), bits.to(torch.int32) - 127)


def scaled_blocks(
    doubled: torch.Tensor, scales: torch.Tensor, block: int, keep_layout: bool
) -> torch.Tensor:
    """`doubled (N, K)` int8 (twice the E2M1 values) times `scales (N, K/B)` float32 -> the
    float32 weight `(N, K)`, with its exact 8-bit `GroupedWeight` attached when `keep_layout`
    (a 2-D weight whose blocks are a multiple of 16)."""
    n, k = doubled.shape[-2:]
    if scales.shape[-1] * block != k:
        raise ValueError(f"scales {tuple(scales.shape)} do not cover {k} columns by {block}")
    halves = scales.float() * 0.5  # (..., N, K/B), exact
    weight = (doubled.float().unflatten(-1, (-1, block)) * halves[..., None]).flatten(-2)
    if keep_layout and doubled.dim() == 2 and block % 16 == 0:
        packed = GroupedWeight(doubled.contiguous(), halves.contiguous(), None, 8, block)
        return attach_packed(weight, packed)
    return weight


def gpt_oss_mxfp4_weights(
    weights: Iterator[tuple[str, Any]], keep_layout: bool
) -> Iterator[tuple[str, Any]]:
    """gpt-oss's MXFP4 (`quant_method: mxfp4`): each `P_blocks` uint8 `(..., N, K/32, 16)` and
    `P_scales` uint8 `(..., N, K/32)` become `P` `(..., N, K)` (a dense `X.weight_blocks` gives
    `X.weight`), `value * 2^(scale - 127)`.

    Raises:
        ValueError: blocks without their scales (or the reverse), or shapes that differ.
    """

    def decode(base: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, Any]]:
        blocks, scales = parts["_blocks"], parts["_scales"]
        if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
            raise ValueError(
                f"{base}_blocks {tuple(blocks.shape)} / {base}_scales {tuple(scales.shape)}: "
                "want (..., N, K/32, 16) and (..., N, K/32)"
            )
        doubled = fp4_doubled(blocks).flatten(-2)  # (..., N, K)
        yield base, scaled_blocks(doubled, e8m0(scales), 32, keep_layout)

    def required(base: str) -> set[str]:
        return {"_blocks", "_scales"}

    suffixes = ("_blocks", "_scales")
    yield from gather_layers(weights, suffixes, ("_blocks",), required, decode, "MXFP4")
