"""Integer codes with per-group scales and zero points, as GPTQ, AWQ and compressed-tensors
store them, turned into the engine's `GroupedWeight` (or, where its layout cannot hold them, a
float weight).

Every such format stores `W[n, k] = scale[n, g] * (q[n, k] - zero[n, g])` with `g = k // G`
and unsigned codes `q` of `bits` bits; as a `GroupedWeight` that is `codes = q` (4-bit, packed
as the engine's nibbles) or `q - 128` (8-bit, int8) and `offsets = -scale * zero` (4-bit) or
`scale * (128 - zero)` (8-bit), in float32. A float16 / bfloat16 scale times an integer under
2^9 needs at most 20 significant bits, so the offsets are exact and `GroupedWeight.dequantize`
gives the format's values bit for bit.

Glossary: N output features, K input features, G weights per group.
"""

from __future__ import annotations

import logging

import torch

from vllm_mamba.layers.packed_weights import attach_packed
from vllm_mamba.ops.grouped_linear import NIBBLE_BLOCK, GroupedWeight, pack_nibbles

__all__ = ["grouped_or_float", "to_float"]

logger = logging.getLogger(__name__)

_GROUP_UNIT = {4: NIBBLE_BLOCK, 8: 16}  # GroupedWeight's group granularity per bit width


def to_float(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, g_idx: torch.Tensor
) -> torch.Tensor:
    """`scale[n, g_idx[k]] * (q[n, k] - zero[n, g_idx[k]])` -> `(N, K)` float32.

    Args:
        q: `(N, K)` integer codes; scales, zeros: `(N, groups)`; g_idx: `(K,)` group of each k.
    """
    zero = 0 if zeros is None else zeros[:, g_idx].float()
    return (q.float() - zero) * scales[:, g_idx].float()


def grouped_or_float(
    name: str,
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    g_idx: torch.Tensor,
) -> torch.Tensor:
    """The float weight `(N, K)` of unsigned codes `q (N, K)` in groups (see the module
    docstring), with its exact `GroupedWeight` attached where the layout holds it: groups
    contiguous along K (`g_idx[k] == k // G`) of a size `GroupedWeight` takes. Otherwise the
    plain float weight (logged, with why).

    Args:
        name: the weight's name (for the log).
        q: `(N, K)` unsigned codes in [0, 2^bits); scales: `(N, K/G)`; zeros: `(N, K/G)` or
            None for zero; g_idx: `(K,)` the group of each input feature.
    """
    weight = to_float(q, scales, zeros, g_idx)  # (N, K) float32
    n, k = q.shape
    groups = scales.shape[1]
    size = k // groups if groups and k % groups == 0 else 0
    unit = _GROUP_UNIT.get(bits)
    if unit is None or size == 0 or size % unit:
        logger.info("%s: groups of %d columns at %d bits run in float", name, size, bits)
        return weight
    if not torch.equal(g_idx.long(), torch.arange(k) // size):
        logger.info("%s: act-order groups (g_idx not contiguous along K) run in float", name)
        return weight
    s = scales.float()  # (N, K/G)
    z = torch.zeros_like(s) if zeros is None else zeros.float()
    if bits == 4:
        codes, offsets = pack_nibbles(q), -s * z  # (N, K/2) uint8
    else:
        codes, offsets = (q.to(torch.int16) - 128).to(torch.int8), s * (128.0 - z)
    offsets = None if not offsets.any() else offsets
    return attach_packed(weight, GroupedWeight(codes.contiguous(), s, offsets, bits, size))
