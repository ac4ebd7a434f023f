"""Stacked experts stored in microscaling formats beside float weights, as the Inkling 2
releases ship them (`thinkingmachines/Inkling-2-Mini`: NVFP4 and MXFP8 experts; no
`quantization_config`): read as float experts, the way transformers' loader dequantises them
(its `Inkling2LoopDequantizeExperts`).

Each `P.w13_weight` / `P.w2_weight` `(E, R, C)` of an MoE (`P` ending in `.mlp.experts`) is one
of:

- float: passed through;
- NVFP4: uint8 E2M1 pairs `(E, R, C/2)` (element 2j in the low nibble) with
  `P.wX_weight_scale` float8 e4m3 `(E, R, C/16)`, `P.wX_weight_amax` and
  `P.wX_weight_outer_scale_denominator` `(E,)`: `value * scale * (amax / denominator)`;
- MXFP8: float8 e4m3 `(E, R, C)` with `P.wX_weight_scale` E8M0 `(E, R, C/32)`:
  `value * 2^(scale - 127)`.

The products are computed in float32 (exact up to the last factor, as transformers rounds
them) and reach the model as the float `P.wX_weight`, which the model splits by expert.

Glossary: E experts, R rows, C columns of one expert's matrix.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.models.prequantized.common import tensor_dtype, whole
from vllm_mamba.models.prequantized.microscaling import e8m0, fp4_doubled

__all__ = ["dequantized_experts"]

_PART = re.compile(
    r"^(?P<base>.*\.mlp\.experts\.w(?:13|2)_weight)"
    r"(?P<part>|_scale|_amax|_outer_scale_denominator)$"
)
_NVFP4_PARTS = {"", "_scale", "_amax", "_outer_scale_denominator"}
_MXFP8_PARTS = {"", "_scale"}
_CODES = (torch.uint8, torch.float8_e4m3fn)  # NVFP4 pairs, MXFP8 values


def _decode(base: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """One stacked expert tensor's float32 values `(E, R, C)`."""
    codes, factor = parts[""], None
    if codes.dtype == torch.uint8:  # NVFP4, blocks of 16: (2 value) * (scale / 2), exact
        block, values = 16, fp4_doubled(codes).float()  # (E, R, C)
        scales = parts["_scale"].float() * 0.5
        factor = parts["_amax"].float() / parts["_outer_scale_denominator"].float()  # (E,)
    else:  # MXFP8, blocks of 32
        block, values, scales = 32, codes.float(), e8m0(parts["_scale"])
    if scales.shape[:-1] != values.shape[:-1] or scales.shape[-1] * block != values.shape[-1]:
        raise ValueError(
            f"{base}: scales {tuple(scales.shape)} do not cover values "
            f"{tuple(values.shape)} in blocks of {block}"
        )
    values = (values.unflatten(-1, (-1, block)) * scales[..., None]).flatten(-2)
    return values if factor is None else values * factor.reshape(-1, 1, 1)


def dequantized_experts(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """`weights` with each NVFP4 / MXFP8 stacked expert tensor and its scales replaced by the
    float tensor under the weight's name (see the module docstring); float experts and every
    other tensor pass unchanged.

    Raises:
        ValueError: quantised experts without their scales (or scales without experts), or
            scales that do not fit.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        match = _PART.match(name)
        if match is None or (match["part"] == "" and tensor_dtype(tensor) not in _CODES):
            yield name, tensor
            continue
        base = match["base"]
        parts = pending.setdefault(base, {})
        parts[match["part"]] = whole(tensor)
        if "" not in parts:
            continue
        need = _NVFP4_PARTS if parts[""].dtype == torch.uint8 else _MXFP8_PARTS
        if need <= parts.keys():
            yield base, _decode(base, pending.pop(base))
    if pending:
        raise ValueError(
            "quantised experts without all of their tensors (weight, _scale, and for NVFP4 "
            f"_amax and _outer_scale_denominator): {', '.join(sorted(pending))}"
        )
