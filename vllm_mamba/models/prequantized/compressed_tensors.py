"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, as llm-compressor
writes them): each `config_groups` entry's `weights` arguments apply to the layers its
`targets` name (`Linear`, a module name or `re:` a regular expression); layers in `ignore`
(often `lm_head`) are plain float `X.weight`. Formats (the config's `format`, or a group's own
in `mixed-precision` configs):

- `pack-quantized` (W4A16 / W8A16): `X.weight_packed` int32 `(N, ceil(K * bits / 32))`,
  code k of a row at bits `bits * (k % per)` of word `k // per`, stored unsigned (the signed
  value + 2^(bits-1)); `X.weight_shape` `[N, K]`; `X.weight_scale` `(N, K/G)` (`group`) or
  `(N, 1)` (`channel`); asymmetric: `X.weight_zero_point` signed, packed along N into int32
  `(ceil(N * bits / 32), K/G)` (or unpacked int8 `(N, K/G)` as older versions wrote);
  `W = scale * (value - zero)`. Read into the grouped 4-bit / 8-bit kernels
  (`prequantized.grouped`); `actorder: group` with its `weight_g_idx` in float where the
  groups are not contiguous.
- `int-quantized` / `naive-quantized` (8-bit): `X.weight` int8 `(N, K)` signed, scales and
  zero points as above (unpacked): the grouped 8-bit kernel.
- `nvfp4-pack-quantized`: `X.weight_packed` uint8 E2M1 pairs, `X.weight_scale` float8
  `(N, K/16)`, `X.weight_global_scale` `(1,)`: `W = value * (scale / global_scale)`;
  `mxfp4-pack-quantized`: E8M0 `weight_scale` `(N, K/32)`. Both exact in the grouped 8-bit
  kernel (`prequantized.microscaling`).
- `float-quantized` (FP8 per tensor / channel / group / block) and `mxfp8-quantized`
  (float8 with E8M0 scales of 32): dequantised to the model's dtype.
- `dense`: float weights; their stored quantisation parameters are dropped.

Activation quantisation (`input_activations`) is not used: activations stay float, and their
scales (`input_scale`, ...) and KV-cache scales are dropped. Sparse formats are refused.

Glossary: N output features, K input features, G weights per group.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.models.prequantized.common import (
    gather_layers,
    tensor_dtype,
    unpack_int32,
)
from vllm_mamba.models.prequantized.grouped import grouped_or_float
from vllm_mamba.models.prequantized.microscaling import e8m0, fp4_doubled, scaled_blocks

__all__ = ["check_compressed_tensors", "compressed_tensors_weights"]

INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
FP4_FORMATS = {"nvfp4-pack-quantized": 16, "mxfp4-pack-quantized": 32}  # block of each
FLOAT_FORMATS = ("float-quantized", "mxfp8-quantized")
FORMATS = (*INT_FORMATS, *FP4_FORMATS, *FLOAT_FORMATS, "dense")
QUANTISED = ".weight@codes"  # an int8 / float8 `X.weight`, renamed while its layer gathers
SUFFIXES = (
    ".weight_packed",
    QUANTISED,
    ".weight_scale",
    ".weight_zero_point",
    ".weight_g_idx",
    ".weight_shape",
    ".weight_global_scale",
)
DROPPED = (
    ".input_scale", ".input_zero_point", ".input_global_scale", ".input_g_idx",
    ".output_scale", ".output_zero_point", ".k_scale", ".v_scale",
)  # fmt: skip


def _groups(config: dict[str, Any]) -> list[dict[str, Any]]:
    groups = config.get("config_groups") or {}
    return [g for g in groups.values() if g.get("weights")]


def _format(config: dict[str, Any], group: dict[str, Any]) -> str:
    return group.get("format") or config.get("format") or "dense"


def check_compressed_tensors(config: dict[str, Any]) -> None:
    """Raises a ValueError naming the field of a compressed-tensors config the engine does
    not read."""
    sparsity = config.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise ValueError(
            f"quantization_config.sparsity_config.format {sparsity['format']!r}: sparse "
            "compressed-tensors checkpoints are not read"
        )
    groups = _groups(config)
    if not groups and config.get("format") != "dense":
        raise ValueError("quantization_config.config_groups: no group quantises weights")
    for group in groups:
        fmt, args = _format(config, group), group["weights"]
        if fmt not in FORMATS:
            raise ValueError(
                f"quantization_config.format {fmt!r}: compressed-tensors is read in "
                f"{', '.join(FORMATS)}"
            )
        kind, bits, strategy = args.get("type", "int"), args.get("num_bits"), args.get("strategy")
        if fmt in INT_FORMATS:
            if kind != "int" or bits not in ((4, 8) if fmt == "pack-quantized" else (8,)):
                raise ValueError(
                    f"quantization_config.config_groups.weights: {kind} {bits}-bit in {fmt!r} "
                    "is not read (int 4 / 8 bits packed, int 8 bits otherwise)"
                )
            if strategy not in ("group", "channel", "tensor"):
                raise ValueError(
                    f"quantization_config.config_groups.weights.strategy {strategy!r}: integer "
                    "weights are read per group, channel or tensor"
                )
        elif fmt in FP4_FORMATS and not args.get("symmetric", True):
            raise ValueError(
                "quantization_config.config_groups.weights.symmetric false: FP4 weights are "
                "read symmetric only"
            )


def _matches(target: str, base: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], base) is not None
    return target in ("Linear", base) or base.endswith("." + target)


def compressed_tensors_weights(
    config: dict[str, Any], weights: Iterator[tuple[str, Any]], keep_layout: bool
) -> Iterator[tuple[str, Any]]:
    """`weights` with each quantised layer's tensors replaced by its `X.weight` (see the module
    docstring); `keep_layout` False (a load-time `quantization=`) gives the FP4 formats as
    plain float weights.

    Raises:
        ValueError: a layer without some of its tensors, tensors that do not fit, or one no
            config group targets.
    """
    groups = _groups(config)

    def group_of(base: str) -> dict[str, Any]:
        found = [g for g in groups if any(_matches(t, base) for t in g.get("targets", ()))]
        if not found and len(groups) != 1:
            raise ValueError(f"{base}: quantised, but no quantization_config group targets it")
        return found[0] if found else groups[0]

    def required(base: str) -> set[str]:
        group = group_of(base)
        fmt, args = _format(config, group), group["weights"]
        need = {".weight_scale"}
        if fmt == "pack-quantized":
            need |= {".weight_packed", ".weight_shape"}
        if fmt == "nvfp4-pack-quantized":
            need.add(".weight_global_scale")
        if fmt in INT_FORMATS and not args.get("symmetric", True):
            need.add(".weight_zero_point")
        if fmt in INT_FORMATS and args.get("actorder") in ("group", True):
            need.add(".weight_g_idx")
        return need

    def decode(base: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, Any]]:
        group = group_of(base)
        fmt, args = _format(config, group), group["weights"]
        name = base + ".weight"
        scale = parts[".weight_scale"]
        if fmt == "dense":
            yield name, parts[QUANTISED]
        elif fmt in FP4_FORMATS:
            block = FP4_FORMATS[fmt]
            if fmt == "mxfp4-pack-quantized":
                scale = e8m0(scale)
            else:
                scale = scale.float() / parts[".weight_global_scale"].float()
            doubled = fp4_doubled(parts[".weight_packed"])  # (N, K)
            yield name, scaled_blocks(doubled, scale, block, keep_layout)
        elif fmt in FLOAT_FORMATS:
            yield name, _float_weight(base, parts[QUANTISED], scale, args)
        else:
            yield name, _int_weight(base, parts, args)

    def renamed() -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            if name.endswith(DROPPED):
                continue
            if name.endswith(".weight") and tensor_dtype(tensor) in _CODE_DTYPES:
                name = name[: -len(".weight")] + QUANTISED
            yield name, tensor

    primary = (".weight_packed", QUANTISED)
    stream = gather_layers(renamed(), SUFFIXES, primary, required, decode, "compressed-tensors")
    for name, tensor in stream:
        if name.endswith(QUANTISED):  # `dense`: a float8 / int8 weight without a scale
            name = name[: -len(QUANTISED)] + ".weight"
        elif config.get("format") == "dense" and name.endswith(SUFFIXES):
            continue
        yield name, tensor


_CODE_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def _broadcast(scale: torch.Tensor, n: int, k: int, args: dict[str, Any]) -> torch.Tensor:
    """A tensor / channel / group / block scale -> one per weight `(N, K)`."""
    s = scale.reshape(1, 1) if scale.dim() < 2 else scale
    rows, cols = s.shape
    if args.get("strategy") == "block":
        bo, bi = args.get("block_structure") or (0, 0)
    else:
        bo, bi = (n // rows if n % rows == 0 else 0), (k // cols if k % cols == 0 else 0)
    if not (bo and bi and (rows, cols) == (-(-n // bo), -(-k // bi))):
        raise ValueError(f"weight_scale {tuple(scale.shape)} does not fit a {n}x{k} weight")
    return s.repeat_interleave(bo, 0)[:n].repeat_interleave(bi, 1)[:, :k]


def _float_weight(
    base: str, weight: torch.Tensor, scale: torch.Tensor, args: dict[str, Any]
) -> torch.Tensor:
    """float8 `(N, K)` times its scales (float, or E8M0 uint8) -> float32 `(N, K)`."""
    s = e8m0(scale) if scale.dtype == torch.uint8 else scale.float()
    try:
        return weight.float() * _broadcast(s, *weight.shape, args)
    except ValueError as err:
        raise ValueError(f"{base}.{err}") from None


def _int_weight(base: str, parts: dict[str, torch.Tensor], args: dict[str, Any]) -> torch.Tensor:
    """Signed integer codes (packed or int8) with scales / zero points -> the float weight,
    its `GroupedWeight` attached (`grouped_or_float`)."""
    bits = int(args["num_bits"])
    scale = parts[".weight_scale"]
    if ".weight_packed" in parts:
        n, k = (int(v) for v in parts[".weight_shape"].tolist())
        q = unpack_int32(parts[".weight_packed"], bits, dim=1)[:, :k]  # (N, K) unsigned
    else:
        q = parts[QUANTISED].to(torch.int32) + (1 << (bits - 1))  # (N, K) unsigned
        n, k = q.shape
    scale = scale.reshape(1, 1).expand(n, 1) if scale.numel() == 1 else scale
    if scale.shape[0] != n or k % scale.shape[1]:
        raise ValueError(f"{base}.weight_scale {tuple(scale.shape)} does not fit ({n}, {k})")
    zero = torch.full(scale.shape, 1 << (bits - 1), dtype=torch.int32)  # unsigned zero
    stored = parts.get(".weight_zero_point")
    if stored is not None and not args.get("symmetric", True):
        if stored.dtype == torch.int32 and stored.shape[0] != n:  # packed along N, unsigned
            stored = unpack_int32(stored, bits, dim=0)[:n] - (1 << (bits - 1))
        zero = zero + stored.reshape(n, -1).to(torch.int32)
    g_idx = parts.get(".weight_g_idx")
    size = k // scale.shape[1]
    g_idx = torch.arange(k) // size if g_idx is None else g_idx.long()
    return grouped_or_float(base + ".weight", q, scale, zero, bits, g_idx)
