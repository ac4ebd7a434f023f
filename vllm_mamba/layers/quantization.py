"""Weight-only int8 quantisation of a loaded float model (`quantization="int8"`).

`quantize_model_int8` turns every `Linear` of the model (mixer projections, attention and MLP
projections of hybrids, the LM head, and their tensor-parallel subclasses) into an int8 layer
in place: its `weight` becomes the int8 `(N, K)` tensor, a `weight_scale (N,)` float32 buffer
holds the per-output-channel scales (`vllm_mamba.ops.int8_linear.quantize_int8`), and its
product runs through the ops table's `int8_linear`. The bias stays float. The module keeps its
class and `forward`, so layers that add communication (row-parallel all-reduce) still work.

What stays float, and why:
- `dt_proj` of the Mamba mixers: the mixers multiply by `dt_proj.weight` directly (its bias
  is added inside the scan) and it is small (`R x I`, about 2% of a Mamba layer's weights),
  while the time step it produces goes through softplus and an exponential, where errors grow.
- routers (`nn.Linear`, not `Linear`) and stacked MoE expert tensors (parameters, not
  `Linear`): they are read directly by the MoE code.
- norms, convolution filters, `A_log`, `D`, biases: vectors, a negligible share of the bytes.
- an untied token embedding: a lookup reads one row per token, so it costs no bandwidth per
  token; a tied one is served from the LM head's int8 table (`Int8Embedding`), so the int8
  model holds the table once.

Glossary: N output features, K input features, V vocabulary, H hidden size.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.parallel_linear import VocabParallelEmbedding
from vllm_mamba.ops.int8_linear import quantize_int8
from vllm_mamba.ops.table import MambaOps

logger = logging.getLogger(__name__)

FLOAT_LINEARS = ("dt_proj",)  # `Linear`s whose weight the mixers read directly


@dataclass(frozen=True)
class QuantizationReport:
    """What `quantize_model_int8` changed: layers and weight bytes before and after."""

    num_linears: int
    bytes_before: int
    bytes_after: int


class Int8Embedding(nn.Module):
    """A token embedding read from an int8 table with per-row scales (the tied LM head's)."""

    def __init__(self, weight: nn.Parameter, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight  # (V, H) int8, the LM head's parameter
        self.register_buffer("weight_scale", scale)  # (V,) float32, the LM head's
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids (T,)` -> `(T, H)` in the model dtype."""
        rows = F.embedding(input_ids, self.weight).float()  # (T, H)
        return (rows * self.weight_scale[input_ids, None]).to(self.dtype)


def _int8_product(
    self: Linear, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The `linear_op` of a quantised `Linear`: `x (..., K)` -> `(..., N)` in x's dtype."""
    if x.dim() == 2:
        return self.int8_op(x, weight, self.weight_scale, bias)
    out = self.int8_op(x.reshape(-1, x.shape[-1]), weight, self.weight_scale, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def is_int8_linear(linear: nn.Module) -> bool:
    """Whether `linear` is a `Linear` that `quantize_linear_int8` made int8."""
    op = getattr(linear, "linear_op", None)
    return (
        isinstance(linear, Linear)
        and linear.weight.dtype == torch.int8
        and getattr(op, "__func__", None) is _int8_product
    )


def quantize_linear_int8(linear: Linear, ops: MambaOps) -> None:
    """Makes `linear`'s weight int8 in place (see the module docstring)."""
    dtype = linear.weight.dtype
    # A row-parallel shard holds some columns of each row: its scales are the whole row's.
    row_absmax = getattr(linear, "row_absmax", None)
    absmax = row_absmax() if row_absmax is not None else None
    qweight, scale = quantize_int8(linear.weight, absmax)  # (N, K) int8, (N,) float32
    linear.weight = nn.Parameter(qweight.to(linear.weight.device), requires_grad=False)
    linear.register_buffer("weight_scale", scale.to(qweight.device))
    linear.activation_dtype = dtype
    linear.int8_op = ops.int8_linear
    linear.linear_op = types.MethodType(_int8_product, linear)


def quantize_model_int8(model: nn.Module, ops: MambaOps) -> QuantizationReport:
    """Quantises every eligible `Linear` of a loaded float model to int8, in place.

    A plain `nn.Embedding` whose weight is tied to a quantised layer (the LM head) is replaced
    by an `Int8Embedding` reading the same int8 table.

    Args:
        model: the model after its weights are loaded and processed.
        ops: the ops table whose `int8_linear` the layers call.

    Returns:
        How many layers were quantised and the weight bytes before and after.
    """
    before = _weight_bytes(model)
    embeddings = {
        id(module.weight): (parent, name)
        for parent in model.modules()
        for name, module in parent.named_children()
        if type(module) is nn.Embedding or isinstance(module, VocabParallelEmbedding)
    }
    quantised = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or name.rsplit(".", 1)[-1] in FLOAT_LINEARS:
            continue
        if module.weight.dtype == torch.int8:  # shared module already done
            continue
        tied = embeddings.get(id(module.weight))
        quantize_linear_int8(module, ops)
        quantised += 1
        if tied is not None:
            parent, child = tied
            embedding = getattr(parent, child)
            if isinstance(embedding, VocabParallelEmbedding):  # this rank's rows of the table
                scale, dtype = module.weight_scale, module.activation_dtype
                embedding.use_int8_table(module.weight, scale, dtype)
                continue
            table = Int8Embedding(module.weight, module.weight_scale, module.activation_dtype)
            setattr(parent, child, table)
    after = _weight_bytes(model)
    logger.info(
        "int8: %d linear layers quantised; weights %.1f MiB -> %.1f MiB",
        quantised, before / 2**20, after / 2**20,
    )  # fmt: skip
    return QuantizationReport(quantised, before, after)


def _weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and persistent buffers, each tensor counted once."""
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())
