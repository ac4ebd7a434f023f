"""Checkpoints that ship quantised weights, read into the engine's float (or int8 / int4) ones.

A pre-quantised checkpoint says so in its config's `quantization_config`; `checkpoint_method`
reads it and refuses what the engine cannot read, and `dequantized_weights` wraps the
checkpoint's tensor stream so that the model sees plain float weights under their usual names.

- **FP8 with block scales** (`quant_method: fp8`, `weight_block_size: [bo, bi]`, as Qwen and
  DeepSeek ship their `-FP8` releases): each `X.weight` is float8 (e4m3) `(O, I)` beside
  `X.weight_scale_inv` float32 `(ceil(O / bo), ceil(I / bi))`; the float weight is the float8
  value times its block's scale, computed in float32 (as transformers dequantises it), then
  stored in the model's dtype (bfloat16 by the checkpoint's `torch_dtype`, or float32). With
  `quantization="int8"` / `"int4"` the dequantised weights are quantised again as they load.
  Static activation scales (`input_scale`) are not used: activations stay in float.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["checkpoint_method", "dequantized_weights"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
READABLE = ("fp8",)


def _quant_config(hf_config: Any) -> dict[str, Any] | None:
    existing = getattr(hf_config, "quantization_config", None)
    if existing is None:
        text = getattr(hf_config, "text_config", None)
        existing = getattr(text, "quantization_config", None) if text is not None else None
    if existing is None:
        return None
    return existing if isinstance(existing, dict) else existing.to_dict()


def checkpoint_method(hf_config: Any) -> str | None:
    """The quantisation the checkpoint itself ships (`fp8`), None for a float checkpoint or a
    load-time quantisation this engine recorded.

    Raises:
        ValueError: a pre-quantised format the engine cannot read (named), or an FP8 config
            without block scales.
    """
    config = _quant_config(hf_config)
    if not config:
        return None
    method = config.get("quant_method")
    if method in ("int8", "int4") and set(config) <= {"quant_method", "checkpoint_quantization"}:
        # the engine's own load-time record (`config.record_quantization`), over the
        # checkpoint's own record when it ships quantised weights
        config = config.get("checkpoint_quantization")
        if not config:
            return None
        method = config.get("quant_method")
    if method not in READABLE:
        raise ValueError(
            f"quantization_config.quant_method {method!r}: this checkpoint is pre-quantised in "
            f"a format the engine does not read (it reads {', '.join(READABLE)}; float "
            "checkpoints can be quantised at load with quantization='int8' or 'int4')"
        )
    block = config.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(b > 0 for b in block)):
        raise ValueError(
            "quantization_config.weight_block_size: FP8 checkpoints are read with block scales "
            f"([rows, columns]), got {block!r}"
        )
    return method


def _dequantize_fp8(
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


def _whole(tensor: Any) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor[...]


def dequantized_weights(
    hf_config: Any, weights: Iterator[tuple[str, Any]]
) -> Iterator[tuple[str, Any]]:
    """`weights` with the checkpoint's quantised tensors replaced by float ones (see the module
    docstring); `weights` itself for a float checkpoint.

    Raises:
        ValueError: a float8 weight without its scale (or a scale without its weight), or a
            scale that does not fit its weight.
    """
    if checkpoint_method(hf_config) != "fp8":
        yield from weights
        return
    config = _quant_config(hf_config)
    block = list(config.get("checkpoint_quantization", config)["weight_block_size"])
    pending: dict[str, torch.Tensor] = {}  # a weight or a scale whose partner is not read yet
    for name, tensor in weights:
        if name.endswith((".input_scale", ".activation_scale")):
            continue
        if name.endswith(".weight_scale_inv"):
            base, partner = name[: -len("_scale_inv")], name
        elif name.endswith(".weight") and _whole_dtype(tensor) in FP8_DTYPES:
            base, partner = name, name + "_scale_inv"
        else:
            yield name, tensor
            continue
        pending[name] = _whole(tensor)
        if base in pending and partner in pending:
            weight, scale = pending.pop(base), pending.pop(partner)
            yield base, _dequantize_fp8(weight, scale, block)
    if pending:
        raise ValueError(
            "FP8 checkpoint: weights without their scales or scales without their weights: "
            + ", ".join(sorted(pending))
        )


def _whole_dtype(tensor: Any) -> torch.dtype | None:
    """The dtype of a tensor or a safetensors slice (read from its header, not its data)."""
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype
    get_dtype = getattr(tensor, "get_dtype", None)
    if get_dtype is None:
        return None
    return {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}.get(get_dtype())
