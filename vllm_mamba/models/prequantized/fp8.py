"""FP8 checkpoints with block scales (`quant_method: fp8`, `weight_block_size: [bo, bi]`, as
Qwen and DeepSeek ship their `-FP8` releases), read as float weights.

Each `X.weight` is float8 (e4m3) `(O, I)` beside `X.weight_scale_inv` float32
`(ceil(O / bo), ceil(I / bi))`; the float weight is the float8 value times its block's scale,
computed in float32 (as transformers dequantises it), then stored in the model's dtype
(bfloat16 by the checkpoint's `torch_dtype`, or float32). With `quantization="int8"` /
`"int4"` the dequantised weights are quantised again as they load. Static activation scales
(`input_scale`) are not used: activations stay in float.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.models.prequantized.common import tensor_dtype, whole

__all__ = ["FP8_DTYPES", "check_fp8", "dequantize_blocks", "fp8_weights"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
ACTIVATION_SUFFIXES = (".input_scale", ".activation_scale")


def check_fp8(config: dict[str, Any]) -> None:
    """Raises a ValueError naming `weight_block_size` when it is not `[rows, columns]`."""
    block = config.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(b > 0 for b in block)):
        raise ValueError(
            "quantization_config.weight_block_size: FP8 checkpoints are read with block scales "
            f"([rows, columns]), got {block!r}"
        )


def dequantize_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int]
) -> torch.Tensor:
    """float8 `(O, I)` times its blocks' scales `(ceil(O / bo), ceil(I / bi))`, float32."""
    rows, cols = weight.shape
    bo, bi = block
    if tuple(scale_inv.shape) != (math.ceil(rows / bo), math.ceil(cols / bi)):
        raise ValueError(
            f"weight_scale_inv {tuple(scale_inv.shape)} does not cover a {rows}x{cols} weight "
            f"in blocks of {bo}x{bi}"
        )
    scale = scale_inv.float().repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
    return weight.float() * scale


def fp8_weights(
    config: dict[str, Any], weights: Iterator[tuple[str, Any]]
) -> Iterator[tuple[str, Any]]:
    """`weights` with each float8 weight and its `weight_scale_inv` replaced by the float one.

    Raises:
        ValueError: a float8 weight without its scale (or a scale without its weight), or a
            scale that does not fit its weight.
    """
    block = list(config["weight_block_size"])
    pending: dict[str, torch.Tensor] = {}  # a weight or a scale whose partner is not read yet
    for name, tensor in weights:
        if name.endswith(ACTIVATION_SUFFIXES):
            continue
        if name.endswith(".weight_scale_inv"):
            base, partner = name[: -len("_scale_inv")], name
        elif name.endswith(".weight") and tensor_dtype(tensor) in FP8_DTYPES:
            base, partner = name, name + "_scale_inv"
        else:
            yield name, tensor
            continue
        pending[name] = whole(tensor)
        if base in pending and partner in pending:
            weight, scale = pending.pop(base), pending.pop(partner)
            yield base, dequantize_blocks(weight, scale, block)
    if pending:
        raise ValueError(
            "FP8 checkpoint: weights without their scales or scales without their weights: "
            + ", ".join(sorted(pending))
        )
