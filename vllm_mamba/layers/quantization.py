"""Load-time quantisation of a float model: weight-only (`quantization="int8"` or `"int4"`) or
with integer dot products (`"w8a8"`, `"w4a8"`, `"w4a8_k"`).

`quantize_model(model, ops, method)` turns every `Linear` of the model (mixer projections,
attention and MLP projections of hybrids, the LM head, and their tensor-parallel subclasses)
into a quantised layer in place, and its product runs through the ops table's `int8_linear` or
`int4_linear`. The bias stays float. The module keeps its class and `forward`, so layers that
add communication (row-parallel all-reduce) still work.
- int8: `weight` becomes the int8 `(N, K)` tensor and a `weight_scale (N,)` float32 buffer
  holds the per-output-channel scales (`vllm_mamba.ops.int8_linear.quantize_int8`).
- int4: `weight` becomes the packed uint8 `(N, K/2)` tensor and `weight_scale (N, K/32)` the
  float16 scales of its groups of 32 (`vllm_mamba.ops.int4_linear.quantize_int4`). A layer
  whose K is not a multiple of 32 cannot be grouped: it is quantised to int8 instead (logged
  and counted in the report). The LM head (and a tied embedding with it) is int8 too, as
  llama.cpp keeps its Q4_0 models' output tensor at 6 bits: on the shipped model (200
  held-out windows) an int4 head raises the held-out loss by 0.46% over float32 and an int8
  head by 0.16% (top-1 agreement 88.3% against 92.2%). int4 runs on one rank only (the
  loader refuses `tensor_parallel_size > 1`).
- w8a8 / w4a8: the weights of int8 / int4 (the same fallbacks, the LM head int8 under w4a8),
  and each `Linear` sets `int_dot = True` (`uses_int_dot`) and runs `w8a8_linear` /
  `w4a8_linear` at every number of rows (decode and prefill alike, so a sequence's numerics do
  not depend on the batch): its input rows are quantised to int8 blocks of 32 with a float32
  scale each (llama.cpp's Q8_0) and multiplied in integers (`vllm_mamba.ops.int_dot_linear`).
  A layer whose K is not a multiple of 32 stays int8 weight-only (logged and counted in the
  report's `weight_only`).
- w4a8_k: as w4a8, the 4-bit weights in the Q4_K-style layout (`vllm_mamba.ops.q4k`: codes in
  [0, 15] with a 6-bit scale and min per block of 32 under float16 super-block scales, 4.5
  bits a weight as Q4_0, lower error on asymmetric rows), through the same `w4a8_linear`.

What stays float, and why:
- `dt_proj` of the Mamba mixers: the mixers multiply by `dt_proj.weight` directly (its bias
  is added inside the scan) and it is small (`R x I`, about 2% of a Mamba layer's weights),
  while the time step it produces goes through softplus and an exponential, where errors grow.
- routers (`nn.Linear`, not `Linear`) and stacked MoE expert tensors (parameters, not
  `Linear`): they are read directly by the MoE code.
- norms, convolution filters, `A_log`, `D`, biases: vectors, a negligible share of the bytes.
- an untied token embedding: a lookup reads one row per token, so it costs no bandwidth per
  token; a tied one is served from the LM head's quantised table (`Int8Embedding`,
  `Int4Embedding`), so the quantised model holds the table once.

Glossary: N output features, K input features, V vocabulary, H hidden size.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from vllm_mamba.layers.decode_plan import drop_decode_plans
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.parallel_linear import VocabParallelEmbedding
from vllm_mamba.ops.int4_linear import dequantize_int4, int4_supported, quantize_int4
from vllm_mamba.ops.int8_linear import quantize_int8
from vllm_mamba.ops.int_dot_linear import (
    GROUP_BYTES,
    int_dot_supported,
    pack_w4a8,
    pack_w8a8,
    strip_rows,
    unpack_w4a8,
    unpack_w8a8,
)
from vllm_mamba.ops.q4k import dequantize_q4k, quantize_q4k
from vllm_mamba.ops.table import MambaOps

logger = logging.getLogger(__name__)

FLOAT_LINEARS = ("dt_proj", "kv_b_proj")  # `Linear`s whose weight the layers read directly
# (MLA keeps float32 `W_UK` / `W_UV` copies of `kv_b_proj` for decode: an int8 `kv_b_proj` would
# save no memory and make the prefill's expansion disagree with decode)
INT8_UNDER_INT4 = ("lm_head",)  # `Linear`s that int4 quantises to int8 (see the docstring)
# Each method: the weight format ("int8", "int4" or the Q4_K-style "int4_k") and whether
# products use integer dots.
METHODS = {"int8": ("int8", False), "int4": ("int4", False), "w8a8": ("int8", True),
           "w4a8": ("int4", True), "w4a8_k": ("int4_k", True)}  # fmt: skip
FOUR_BIT = ("int4", "int4_k")


@dataclass(frozen=True)
class QuantizationReport:
    """What `quantize_model` changed: layers and weight bytes before and after.

    `int8_fallbacks` names the layers that int4 / w4a8 left in int8 (K not a multiple of 32);
    `weight_only` the layers that w8a8 / w4a8 left weight-only (the same reason).
    """

    num_linears: int
    bytes_before: int
    bytes_after: int
    int8_fallbacks: tuple[str, ...] = ()
    weight_only: tuple[str, ...] = ()


def table_rows(weight: torch.Tensor, rows: torch.Tensor, strips: bool, group: int) -> torch.Tensor:
    """Rows `rows (T,)` of a quantised LM head's table as plain rows: integer-dot tables are in
    the strip layout (`int_dot_linear.strip_rows`; `group` 4 for codes, 1 for 4-bit scales)."""
    return strip_rows(weight, rows, group) if strips else weight[rows]


class Int8Embedding(nn.Module):
    """A token embedding read from an int8 table with per-row scales (the tied LM head's;
    `strips`: in the integer-dot strip layout)."""

    def __init__(
        self, weight: nn.Parameter, scale: torch.Tensor, dtype: torch.dtype, strips: bool = False
    ) -> None:
        super().__init__()
        self.weight = weight  # (V, H) int8, the LM head's parameter
        self.register_buffer("weight_scale", scale)  # (V,) float32, the LM head's
        self.dtype = dtype
        self.strips = strips

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids (T,)` -> `(T, H)` in the model dtype."""
        rows = table_rows(self.weight, input_ids, self.strips, GROUP_BYTES).float()  # (T, H)
        return (rows * self.weight_scale[input_ids, None]).to(self.dtype)


class Int4Embedding(nn.Module):
    """A token embedding read from a 4-bit table with group scales (the tied LM head's;
    `strips`: in the integer-dot strip layout)."""

    def __init__(
        self, weight: nn.Parameter, scales: torch.Tensor, dtype: torch.dtype, strips: bool = False
    ) -> None:
        super().__init__()
        self.weight = weight  # (V, H/2) uint8, the LM head's parameter
        self.register_buffer("weight_scale", scales)  # (V, H/32) float16, the LM head's
        self.dtype = dtype
        self.strips = strips

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids (T,)` -> `(T, H)` in the model dtype (only the looked-up rows widened)."""
        codes = table_rows(self.weight, input_ids, self.strips, GROUP_BYTES)
        scales = table_rows(self.weight_scale, input_ids, self.strips, 1)
        if scales.dtype == torch.uint8:  # Q4_K-style scale bytes (`ops.q4k`)
            return dequantize_q4k(codes, scales, self.dtype)
        return dequantize_int4(codes, scales, self.dtype)


def _product(
    op: Callable[..., torch.Tensor],
    self: Linear,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`op(x, weight, scale, bias)` for `x (..., K)` -> `(..., N)` in x's dtype."""
    if x.dim() == 2:
        return op(x, weight, self.weight_scale, bias)
    out = op(x.reshape(-1, x.shape[-1]), weight, self.weight_scale, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _int8_product(
    self: Linear, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The `linear_op` of an int8 `Linear`: `x (..., K)` -> `(..., N)` in x's dtype."""
    return _product(self.int8_op, self, x, weight, bias)


def _int4_product(
    self: Linear, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The `linear_op` of a 4-bit `Linear`: `x (..., K)` -> `(..., N)` in x's dtype."""
    return _product(self.int4_op, self, x, weight, bias)


def _is_quantised(linear: nn.Module, dtype: torch.dtype, product: Callable) -> bool:
    """Whether `linear` is a `Linear` with a `dtype` weight whose `linear_op` is `product`."""
    op = getattr(linear, "linear_op", None)
    return (
        isinstance(linear, Linear)
        and linear.weight.dtype == dtype
        and getattr(op, "__func__", None) is product
    )


def is_int8_linear(linear: nn.Module) -> bool:
    """Whether `linear` is a `Linear` that `quantize_linear_int8` made int8."""
    return _is_quantised(linear, torch.int8, _int8_product)


def is_int4_linear(linear: nn.Module) -> bool:
    """Whether `linear` is a `Linear` that `quantize_linear_int4` made 4-bit."""
    return _is_quantised(linear, torch.uint8, _int4_product)


def uses_int_dot(linear: nn.Module) -> bool:
    """Whether an int8 / 4-bit `Linear` multiplies int8-quantised activations (integer dot
    products: `quantization="w8a8"` / `"w4a8"`) rather than float32 ones (weight-only)."""
    return bool(getattr(linear, "int_dot", False))


def plain_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantised `Linear`'s (or quantised tied embedding's) weight and scales in the plain
    layouts (`quantize_int8` / `quantize_int4`'s): integer-dot weights are stored in strips."""
    weight, scale = module.weight, module.weight_scale
    if not (uses_int_dot(module) or getattr(module, "strips", False)):
        return weight, scale
    if weight.dtype == torch.uint8:
        return unpack_w4a8(weight, scale)
    return unpack_w8a8(weight), scale


def _replace_weight(linear: Linear, qweight: torch.Tensor, scale: torch.Tensor) -> None:
    """Puts the quantised weight and its scales on `linear`, where the float weight was."""
    linear.activation_dtype = linear.weight.dtype
    linear.weight = nn.Parameter(qweight.to(linear.weight.device), requires_grad=False)
    linear.register_buffer("weight_scale", scale.to(linear.weight.device))


def quantize_linear_int8(linear: Linear, ops: MambaOps, int_dot: bool = False) -> None:
    """Makes `linear`'s weight int8 in place (see the module docstring); `int_dot`: its products
    run `w8a8_linear` (K must be a multiple of 32)."""
    # A row-parallel shard holds some columns of each row: its scales are the whole row's.
    row_absmax = getattr(linear, "row_absmax", None)
    absmax = row_absmax() if row_absmax is not None else None
    qweight, scale = quantize_int8(linear.weight, absmax)  # (N, K) int8, (N,) float32
    _replace_weight(linear, pack_w8a8(qweight) if int_dot else qweight, scale)
    linear.int8_op = ops.w8a8_linear if int_dot else ops.int8_linear
    linear.int_dot = int_dot
    linear.linear_op = types.MethodType(_int8_product, linear)


def quantize_linear_int4(
    linear: Linear, ops: MambaOps, int_dot: bool = False, fmt: str = "int4"
) -> None:
    """Makes `linear`'s weight 4-bit in place (K a multiple of 32; see the module docstring);
    `int_dot`: its products run `w4a8_linear`; `fmt` "int4_k": the Q4_K-style layout (integer
    dots only)."""
    if fmt == "int4_k":
        use_int4_weight(linear, *quantize_q4k(linear.weight), ops, int_dot=True)
    else:
        use_int4_weight(linear, *quantize_int4(linear.weight), ops, int_dot)


def use_int4_weight(
    linear: Linear,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    ops: MambaOps,
    int_dot: bool = False,
) -> None:
    """Puts the 4-bit `qweight (N, K/2)` uint8 with its `scales (N, K/32)` float16 on `linear`
    in place of its float weight (`quantize_int4`'s layout; also a checkpoint's Q4_0 blocks; or
    the Q4_K-style `(N, S * 16)` uint8 scale bytes of `quantize_q4k`, with `int_dot` only),
    so that it runs `int4_linear` (`w4a8_linear` with `int_dot`) and the fused decode layers
    take it (`is_int4_linear`)."""
    if int_dot:
        qweight, scales = pack_w4a8(qweight, scales)
    _replace_weight(linear, qweight, scales)
    linear.int4_op = ops.w4a8_linear if int_dot else ops.int4_linear
    linear.int_dot = int_dot
    linear.linear_op = types.MethodType(_int4_product, linear)


def quantize_model(
    model: nn.Module, ops: MambaOps, method: str, prefix: str = ""
) -> QuantizationReport:
    """Quantises every eligible `Linear` of a loaded float model to `method`, in place.

    A plain `nn.Embedding` whose weight is tied to a quantised layer (the LM head) is replaced
    by an `Int8Embedding` / `Int4Embedding` reading the same table. The layers' decode plans
    are dropped (they hold the float weights): the state cache's binding makes new ones.

    Args:
        model: the model after its weights are loaded and processed.
        ops: the ops table whose `int8_linear` / `int4_linear` the layers call.
        method: "int8", "int4", "w8a8", "w4a8" or "w4a8_k" (`METHODS`; under int4 / w4a8 /
            w4a8_k the LM head and layers whose K is not a multiple of 32 get int8; under the
            integer-dot methods the layers whose K is not a multiple of 32 stay weight-only).
        prefix: `model`'s name in the whole model when it is a part of one ("lm_head", a
            decoder layer's name): the names the rules above and the report go by.

    Returns:
        How many layers were quantised, the weight bytes before and after, the fallbacks to
        int8 and to weight-only products.

    Raises:
        ValueError: `method` is not one of `METHODS`.
    """
    if method not in METHODS:
        raise ValueError(f"quantization {method!r}: use one of {', '.join(METHODS)}")
    fmt, int_dot = METHODS[method]
    drop_decode_plans(model)
    before = _weight_bytes(model)
    embeddings = {
        id(module.weight): (parent, name)
        for parent in model.modules()
        for name, module in parent.named_children()
        if type(module) is nn.Embedding or isinstance(module, VocabParallelEmbedding)
    }
    quantised, fallbacks, weight_only = 0, [], []
    for name, module in list(model.named_modules(prefix=prefix)):
        if not isinstance(module, Linear) or name.rsplit(".", 1)[-1] in FLOAT_LINEARS:
            continue
        if module.weight.dtype in (torch.int8, torch.uint8):  # shared module already done
            continue
        tied = embeddings.get(id(module.weight))
        leaf = name.rsplit(".", 1)[-1]
        dots = int_dot and int_dot_supported(module.weight.shape[1])
        if int_dot and not dots:
            weight_only.append(name)
        if fmt in FOUR_BIT and int4_supported(module.weight) and leaf not in INT8_UNDER_INT4:
            quantize_linear_int4(module, ops, dots, fmt)
        else:
            if fmt in FOUR_BIT and leaf not in INT8_UNDER_INT4:
                fallbacks.append(name)
            quantize_linear_int8(module, ops, dots)
        quantised += 1
        if tied is not None:
            parent, child = tied
            embedding = getattr(parent, child)
            scale, dtype = module.weight_scale, module.activation_dtype
            if isinstance(embedding, VocabParallelEmbedding):  # this rank's rows (int8 only)
                embedding.use_int8_table(module.weight, scale, dtype, strips=dots)
                continue
            table_cls = Int4Embedding if module.weight.dtype == torch.uint8 else Int8Embedding
            setattr(parent, child, table_cls(module.weight, scale, dtype, strips=dots))
    after = _weight_bytes(model)
    if fallbacks:
        logger.info(
            "%s: %d layers have K not a multiple of 32 and are int8 instead: %s",
            method, len(fallbacks), ", ".join(fallbacks),
        )  # fmt: skip
    if weight_only:
        logger.info(
            "%s: %d layers have K not a multiple of 32 and multiply float activations "
            "(weight-only int8): %s", method, len(weight_only), ", ".join(weight_only),
        )  # fmt: skip
    logger.info(
        "%s: %d linear layers quantised; weights %.1f MiB -> %.1f MiB",
        method, quantised, before / 2**20, after / 2**20,
    )  # fmt: skip
    return QuantizationReport(quantised, before, after, tuple(fallbacks), tuple(weight_only))


def quantize_model_int8(model: nn.Module, ops: MambaOps) -> QuantizationReport:
    """`quantize_model(model, ops, "int8")`."""
    return quantize_model(model, ops, "int8")


def _weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and persistent buffers, each tensor counted once."""
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())
