"""Checkpoints that ship quantised weights, read into the engine's float or integer weights.

A pre-quantised checkpoint says so in its config's `quantization_config`; `checkpoint_method`
reads it and refuses what the engine cannot read (one ValueError naming the field), and
`dequantized_weights` wraps the checkpoint's tensor stream so that the model sees its usual
`X.weight` names: float values, with the exact integer layout attached
(`layers.packed_weights.attach_packed`) where the format's codes fit the grouped kernels.
One module per format:

- `fp8`: FP8 with block scales (`quant_method: fp8`) -> the model's dtype;
- `gptq`: GPTQ (`gptq`, 4 / 8 bits) and AWQ (`awq`, gemm) -> grouped 4-bit / 8-bit codes;
- `compressed_tensors`: `compressed-tensors` (pack-quantized, int-quantized, NVFP4, MXFP4,
  FP8 / MXFP8, dense);
- `microscaling`: FP4 decoding shared with gpt-oss's `quant_method: mxfp4`.

`docs/quantization.md` says which kernel each lands in, and what `quantization=` does to each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from vllm_mamba.models.prequantized.common import quant_config, requantized_at_load
from vllm_mamba.models.prequantized.compressed_tensors import (
    check_compressed_tensors,
    compressed_tensors_weights,
)
from vllm_mamba.models.prequantized.fp8 import check_fp8, fp8_weights
from vllm_mamba.models.prequantized.gptq import (
    awq_weights,
    check_awq,
    check_gptq,
    gptq_weights,
)
from vllm_mamba.models.prequantized.microscaling import gpt_oss_mxfp4_weights

__all__ = ["READABLE", "checkpoint_method", "dequantized_weights"]

# quant_method -> the check that refuses what the engine cannot read in it
CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "fp8": check_fp8,
    "gptq": check_gptq,
    "awq": check_awq,
    "compressed-tensors": check_compressed_tensors,
    "mxfp4": lambda config: None,
}
READABLE = tuple(CHECKS)


def checkpoint_method(hf_config: Any) -> str | None:
    """The quantisation the checkpoint itself ships (a `quant_method` of `READABLE`), None for
    a float checkpoint.

    Raises:
        ValueError: a pre-quantised format the engine cannot read, or a variant of a readable
            one it does not (naming the config field).
    """
    config = quant_config(hf_config)
    if not config:
        return None
    method = config.get("quant_method")
    check = CHECKS.get(method)
    if check is None:
        raise ValueError(
            f"quantization_config.quant_method {method!r}: this checkpoint is pre-quantised in "
            f"a format the engine does not read (it reads {', '.join(READABLE)}; float "
            "checkpoints can be quantised at load with quantization='int8' or 'int4')"
        )
    check(config)
    return method


def dequantized_weights(
    hf_config: Any, weights: Iterator[tuple[str, Any]]
) -> Iterator[tuple[str, Any]]:
    """`weights` with the checkpoint's quantised tensors replaced by the model's `X.weight`
    (see the module docstring); `weights` itself for a float checkpoint.

    Raises:
        ValueError: a quantised layer without some of its tensors, or tensors that do not fit.
    """
    method = checkpoint_method(hf_config)
    config = quant_config(hf_config)
    keep_layout = not requantized_at_load(hf_config)
    if method == "fp8":
        yield from fp8_weights(config, weights)
    elif method == "gptq":
        yield from gptq_weights(config, weights)
    elif method == "awq":
        yield from awq_weights(config, weights)
    elif method == "compressed-tensors":
        yield from compressed_tensors_weights(config, weights, keep_layout)
    elif method == "mxfp4":
        yield from gpt_oss_mxfp4_weights(weights, keep_layout)
    else:
        yield from weights
