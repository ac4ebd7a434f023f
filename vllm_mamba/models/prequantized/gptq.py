"""GPTQ and AWQ checkpoints (int4 / int8 codes packed in int32 words, groups along K with
float16 scales and zero points), read into `GroupedWeight`s (`prequantized.grouped`).

- **GPTQ** (`quant_method: gptq`, `bits` 4 or 8, `group_size` (-1 for one group per row),
  `desc_act`, `sym`): `X.qweight` int32 `(K * bits / 32, N)` packs each column's codes along K
  (code k at bits `bits * (k % per)` of word `k // per`), `X.qzeros` int32
  `(K / G, N * bits / 32)` packs the zero points along N the same way, `X.scales`
  `(K / G, N)`, `X.g_idx` `(K,)` the group of each input feature. `checkpoint_format: gptq`
  (v1, AutoGPTQ's and optimum's default) stores each zero point minus one, as GPTQ's kernels
  expect: the zero is the stored value + 1 (so 1..16 at 4 bits), as gptqmodel converts v1 to
  v2; `gptq_v2` stores the zero itself. With `desc_act` and a `g_idx` that is not
  `k // G` (act-order), the groups are not contiguous along K: the layer is read as float
  weights (logged); an exact reorder would need the activations permuted before every
  product.
- **AWQ** (`quant_method: awq`, `version: gemm`, `bits` 4, `zero_point: true`): `X.qweight`
  int32 `(K, N / 8)` packs eight output columns per word in AWQ's interleaved order (nibble i
  holds column `8 m + [0, 2, 4, 6, 1, 3, 5, 7][i]`), `X.qzeros` `(K / G, N / 8)` likewise
  (zero stored as is), `X.scales` `(K / G, N)`.

Either way `W[n, k] = scales[g, n] * (q[k, n] - zero[g, n])`, `g` the group of k.

Glossary: N output features, K input features, G weights per group.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.models.prequantized.common import gather_layers, unpack_int32
from vllm_mamba.models.prequantized.grouped import grouped_or_float

__all__ = ["awq_weights", "check_awq", "check_gptq", "gptq_weights"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]
GPTQ_FORMATS = ("gptq", "gptq_v2")
SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


def _field(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    return next((config[n] for n in names if n in config), default)


def check_gptq(config: dict[str, Any]) -> None:
    """Raises a ValueError naming the field of a GPTQ config the engine does not read."""
    bits = config.get("bits")
    if bits not in (4, 8):
        raise ValueError(f"quantization_config.bits {bits!r}: GPTQ is read at 4 or 8 bits")
    group = config.get("group_size", -1)
    if not isinstance(group, int) or (group != -1 and group <= 0):
        raise ValueError(f"quantization_config.group_size {group!r}: a positive size or -1")
    fmt = _field(config, "checkpoint_format", "format", default="gptq")
    if fmt not in GPTQ_FORMATS:
        raise ValueError(
            f"quantization_config.checkpoint_format {fmt!r}: GPTQ is read in "
            f"{' / '.join(GPTQ_FORMATS)} layout"
        )


def check_awq(config: dict[str, Any]) -> None:
    """Raises a ValueError naming the field of an AWQ config the engine does not read."""
    bits = _field(config, "bits", "w_bit")
    if bits != 4:
        raise ValueError(f"quantization_config.bits {bits!r}: AWQ is read at 4 bits")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version {version!r}: AWQ is read as 'gemm'")
    if not config.get("zero_point", True):
        raise ValueError("quantization_config.zero_point false: AWQ is read with zero points")
    group = _field(config, "group_size", "q_group_size", default=128)
    if not isinstance(group, int) or (group != -1 and group <= 0):
        raise ValueError(f"quantization_config.group_size {group!r}: a positive size or -1")


def _check_shapes(base: str, scales: torch.Tensor, zeros: torch.Tensor, k: int, n: int) -> None:
    if scales.dim() != 2 or scales.shape[1] != n or zeros.shape != scales.shape:
        raise ValueError(
            f"{base}: scales {tuple(scales.shape)} / qzeros (unpacked {tuple(zeros.shape)}) do "
            f"not fit a weight of {k} inputs and {n} outputs"
        )


def gptq_weights(
    config: dict[str, Any], weights: Iterator[tuple[str, Any]]
) -> Iterator[tuple[str, Any]]:
    """`weights` with each GPTQ layer's tensors replaced by `X.weight` (see the module
    docstring).

    Raises:
        ValueError: a layer without some of its tensors, or tensors that do not fit.
    """
    bits = config["bits"]
    v1 = _field(config, "checkpoint_format", "format", default="gptq") == "gptq"
    act_order = bool(config.get("desc_act", False))

    def decode(base: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, Any]]:
        q = unpack_int32(parts[".qweight"], bits, dim=0)  # (K, N)
        k, n = q.shape
        scales = parts[".scales"]  # (K/G, N)
        zeros = unpack_int32(parts[".qzeros"], bits, dim=1)[:, :n] + (1 if v1 else 0)
        _check_shapes(base, scales, zeros, k, n)
        size = k // scales.shape[0]
        g_idx = parts[".g_idx"].long() if act_order else torch.arange(k) // size
        if g_idx.shape != (k,) or int(g_idx.max()) >= scales.shape[0]:
            raise ValueError(f"{base}.g_idx {tuple(g_idx.shape)} does not fit {k} inputs")
        weight = grouped_or_float(base + ".weight", q.T, scales.T, zeros.T, bits, g_idx)
        yield base + ".weight", weight

    def required(base: str) -> set[str]:
        return {".qweight", ".qzeros", ".scales"} | ({".g_idx"} if act_order else set())

    stream = gather_layers(weights, SUFFIXES, (".qweight",), required, decode, "GPTQ")
    yield from ((n, t) for n, t in stream if not n.endswith(".g_idx"))


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ words `(R, N / 8)` -> the codes `(R, N)` in column order."""
    fields = unpack_int32(packed, 4, dim=1)  # (R, N): field i of word m at 8 m + i
    n = fields.shape[1]
    inverse = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])  # column j <- field
    index = (torch.arange(n) // 8 * 8).reshape(-1, 8) + inverse  # (N/8, 8)
    return fields[:, index.reshape(-1)]


def awq_weights(
    config: dict[str, Any], weights: Iterator[tuple[str, Any]]
) -> Iterator[tuple[str, Any]]:
    """`weights` with each AWQ layer's tensors replaced by `X.weight` (see the module
    docstring).

    Raises:
        ValueError: a layer without some of its tensors, or tensors that do not fit.
    """

    def decode(base: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, Any]]:
        q = _awq_columns(parts[".qweight"])  # (K, N)
        k, n = q.shape
        scales = parts[".scales"]  # (K/G, N)
        zeros = _awq_columns(parts[".qzeros"])  # (K/G, N)
        _check_shapes(base, scales, zeros, k, n)
        g_idx = torch.arange(k) // (k // scales.shape[0])
        yield base + ".weight", grouped_or_float(base + ".weight", q.T, scales.T, zeros.T, 4, g_idx)

    def required(base: str) -> set[str]:
        return {".qweight", ".qzeros", ".scales"}

    yield from gather_layers(weights, SUFFIXES[:3], (".qweight",), required, decode, "AWQ")
