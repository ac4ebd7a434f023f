"""What every pre-quantised format shares: the checkpoint's `quantization_config`, header
dtypes of lazy safetensors slices, and the gathering of one layer's several tensors
(`weight` + `scale` + `zero point` ...) out of a stream that yields them in any order.

Glossary: N output features, K input features, G weights per group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from vllm_mamba.config import QUANTIZATION_CHOICES, recorded_quantization

__all__ = [
    "LayerDecoder",
    "gather_layers",
    "quant_config",
    "requantized_at_load",
    "tensor_dtype",
    "unpack_int32",
    "whole",
]

# safetensors header dtype names -> torch dtypes (only those the formats test for)
_HEADER_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I32": torch.int32,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}

# decode(base, tensors by suffix) -> the (name, tensor) pairs the model loads
LayerDecoder = Callable[[str, dict[str, torch.Tensor]], Iterator[tuple[str, Any]]]


def quant_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's own `quantization_config` (a dict), under the engine's load-time record
    (`checkpoint_quantization`) when `quantization=` was asked of a pre-quantised checkpoint;
    None for a float checkpoint."""
    existing = getattr(hf_config, "quantization_config", None)
    if existing is None:
        text = getattr(hf_config, "text_config", None)
        existing = getattr(text, "quantization_config", None) if text is not None else None
    if existing is None:
        return None
    config = existing if isinstance(existing, dict) else existing.to_dict()
    if config.get("quant_method") in QUANTIZATION_CHOICES and set(config) <= {
        "quant_method",
        "checkpoint_quantization",
    }:
        return config.get("checkpoint_quantization") or None
    return config or None


def requantized_at_load(hf_config: Any) -> bool:
    """Whether a load-time `quantization` (`"int8"`, `"int4"`, `"w8a8"`, `"w4a8"`) was asked:
    float formats then load as float weights for the load-time quantiser instead of keeping
    their own layout."""
    return recorded_quantization(hf_config) is not None


def whole(tensor: Any) -> torch.Tensor:
    """A tensor, or a safetensors slice read whole."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor[...]


def tensor_dtype(tensor: Any) -> torch.dtype | None:
    """The dtype of a tensor or a safetensors slice (read from its header, not its data)."""
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype
    get_dtype = getattr(tensor, "get_dtype", None)
    return _HEADER_DTYPES.get(get_dtype()) if get_dtype is not None else None


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned `bits`-wide fields of int32 words, field i at bits `bits * i`, spread along
    `dim`: `(.., W, ..)` -> `(.., W * 32 / bits, ..)` int32 (word w's field i at w * per + i)."""
    per = 32 // bits
    words = packed.to(torch.int32).movedim(dim, -1)  # (..., W)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)  # (per,)
    fields = (words[..., None] >> shifts) & ((1 << bits) - 1)  # (..., W, per)
    return fields.reshape(*words.shape[:-1], words.shape[-1] * per).movedim(-1, dim)


def gather_layers(
    weights: Iterator[tuple[str, Any]],
    suffixes: tuple[str, ...],
    primary: tuple[str, ...],
    required: Callable[[str], set[str]],
    decode: LayerDecoder,
    what: str,
) -> Iterator[tuple[str, Any]]:
    """Yields the stream with each quantised layer's tensors replaced by `decode`'s output.

    A tensor named `base + suffix` (one of `suffixes`) waits under `base` until one of the
    layer's `primary` suffixes (the codes) and everything `required(base)` names have arrived,
    then the layer is decoded. A waiting tensor whose layer never gets a `primary` tensor (an
    unrelated tensor that happens to end in a suffix) is yielded unchanged at the end.

    Raises:
        ValueError: a layer whose `primary` tensor arrived without the rest (`what` names the
            format).
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    primary_set = set(primary)
    for name, tensor in weights:
        suffix = next((s for s in suffixes if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name[: -len(suffix)]
        parts = pending.setdefault(base, {})
        parts[suffix] = tensor
        if not primary_set.isdisjoint(parts) and required(base) <= set(parts):
            yield from decode(base, {s: whole(t) for s, t in pending.pop(base).items()})
    incomplete = []
    for base, parts in pending.items():
        if not primary_set.isdisjoint(parts):
            missing = sorted(required(base) - set(parts))
            incomplete.append(f"{base} (no {', '.join(base + m for m in missing)})")
        else:
            yield from ((base + s, t) for s, t in parts.items())
    if incomplete:
        raise ValueError(f"{what} checkpoint: layers without some tensors: {'; '.join(incomplete)}")
