"""Integer weights that a pre-quantised checkpoint ships, kept as they are in the model.

A checkpoint format that reads integer weights (GGUF blocks, GPTQ / AWQ, compressed-tensors)
yields each such tensor as its float dequantisation (so that every model's `load_weights`,
`expand_weight` and tied parameters work unchanged) with the exact integer layout attached:
`attach_packed(tensor, packed)`. The loader records, per parameter, the layout of the tensor it
copied (`packed_of`), and once the model has processed its weights `install_packed_weights`
puts each recorded layout on its `Linear`, where the float weight was:

- a 4-bit layout that is the engine's own int4 (groups of 32, offsets -8 times scales that
  float16 holds exactly: GGUF's Q4_0) runs through `int4_linear` with float16 scales;
- under `quantization="w4a8"` / `"w4a8_k"` those Q4_0 layers, and under `"w4a8_k"` GGUF's
  Q4_K layers (their super-blocks: `GroupedWeight.super_scales`), multiply int8-quantised
  activations with integer dots on their own codes (`w4a8_linear`: the file's weights at its
  4.5 bits a weight, as llama.cpp runs them); a `Linear` sharing its weight with a token
  embedding (a tied head) stays weight-only, so that the table is held once;
- any other layout runs through `grouped_linear` (`vllm_mamba.ops.grouped_linear`).

A token embedding whose table has a layout is replaced by a `GroupedEmbedding` reading it (a
tied LM head and embedding then hold the codes once). A parameter that the model transformed
after loading (its float weight no longer equals the layout's dequantisation on sampled rows),
or that is neither a `Linear`'s nor an embedding's weight (stacked MoE experts, convolution
filters), keeps the float values; `install_packed_weights` reports how many tensors kept their
integer layout and how many were widened, and why.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_mamba.layers.decode_plan import drop_decode_plans
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.parallel_linear import VocabParallelEmbedding
from vllm_mamba.layers.quantization import use_int4_weight
from vllm_mamba.ops.grouped_linear import NIBBLE_BLOCK, GroupedWeight
from vllm_mamba.ops.int_dot_linear import int_dot_supported
from vllm_mamba.ops.table import MambaOps

__all__ = [
    "PackedReport",
    "attach_packed",
    "cat_rows",
    "install_packed_weights",
    "packed_of",
    "rows_of",
]

logger = logging.getLogger(__name__)

_ATTRIBUTE = "_vllm_mamba_packed"
_SAMPLE_ROWS = 8  # rows compared between a layout and the processed float weight
# Load-time methods under which layouts take integer dots: Q4_0 ("q4_0"), Q4_K ("q4_k").
_INT_DOT_LAYOUTS = {"w4a8": ("q4_0",), "w4a8_k": ("q4_0", "q4_k")}


def attach_packed(tensor: torch.Tensor, packed: GroupedWeight) -> torch.Tensor:
    """Marks the float `tensor` (the dequantised weight) as carrying the integer `packed`."""
    if tuple(tensor.shape) != packed.shape:
        raise ValueError(f"attach_packed: tensor {tuple(tensor.shape)} vs layout {packed.shape}")
    setattr(tensor, _ATTRIBUTE, packed)
    return tensor


def packed_of(tensor: object) -> GroupedWeight | None:
    """The layout attached to `tensor` by `attach_packed`, None for a plain tensor."""
    return getattr(tensor, _ATTRIBUTE, None)


@dataclass
class PackedReport:
    """What `install_packed_weights` did: layers with integer weights, widened tensors."""

    installed: int = 0
    bytes_packed: int = 0
    widened: dict[str, str] = field(default_factory=dict)  # parameter name -> why


def _as_int4(packed: GroupedWeight) -> torch.Tensor | None:
    """The float16 scales under which `packed` is the engine's int4 (Q4_0), else None."""
    if packed.bits != 4 or packed.group != NIBBLE_BLOCK or packed.offsets is None:
        return None
    scales16 = packed.scales.to(torch.float16)
    exact = torch.equal(scales16.float(), packed.scales) and torch.equal(
        packed.offsets, packed.scales * -8.0
    )
    return scales16.contiguous() if exact else None


def _grouped_product(
    self: Linear, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The `linear_op` of a grouped integer `Linear`: `x (..., K)` -> `(..., N)`."""
    flat = x.reshape(-1, x.shape[-1])  # (M, K)
    out = self.grouped_op(
        flat, weight, self.weight_scale, self.weight_offset, bias, self.bits, self.group
    )
    return out.reshape(*x.shape[:-1], out.shape[-1])


def install_packed(
    linear: Linear, packed: GroupedWeight, ops: MambaOps, int_dot: tuple[str, ...] = ()
) -> None:
    """Replaces `linear`'s float weight by `packed` (see the module docstring); `int_dot`: the
    layouts ("q4_0", "q4_k") that take integer dot products."""
    dots = int_dot_supported(packed.shape[1])
    scales16 = _as_int4(packed)
    if scales16 is not None:  # the engine's own int4 (Q4_0): its kernel and fused decode
        use_int4_weight(linear, packed.codes, scales16, ops, dots and "q4_0" in int_dot)
        return
    if packed.super_scales is not None and dots and "q4_k" in int_dot:
        use_int4_weight(linear, packed.codes, packed.super_scales, ops, int_dot=True)
        return
    device = linear.weight.device
    linear.activation_dtype = linear.weight.dtype
    linear.weight = nn.Parameter(packed.codes.to(device), requires_grad=False)
    linear.register_buffer("weight_scale", packed.scales.to(device))
    offsets = None if packed.offsets is None else packed.offsets.to(device)
    linear.register_buffer("weight_offset", offsets)
    linear.bits, linear.group = packed.bits, packed.group
    linear.grouped_op = ops.grouped_linear
    linear.linear_op = types.MethodType(_grouped_product, linear)


def _matches(weight: torch.Tensor, packed: GroupedWeight) -> bool:
    """Whether the float `weight` still equals `packed`'s dequantisation on sampled rows."""
    if tuple(weight.shape) != packed.shape:
        return False
    n = packed.shape[0]
    rows = torch.linspace(0, n - 1, min(n, _SAMPLE_ROWS)).long().unique()
    expected = packed.rows(rows).dequantize(weight.dtype)
    return torch.equal(weight.detach()[rows], expected)


class GroupedEmbedding(nn.Module):
    """A token embedding read from an integer layout (only the looked-up rows widened); it
    shares the codes, scales and offsets with the LM head when the two are tied."""

    def __init__(self, layout: GroupedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("codes", layout.codes)  # (V, H) int8 or (V, H/2) uint8
        self.register_buffer("scales", layout.scales)  # (V, H/G) float32
        self.register_buffer("offsets", layout.offsets)  # (V, H/G) float32 or None
        self.bits, self.group, self.dtype = layout.bits, layout.group, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids (T,)` -> `(T, H)` in the model dtype."""
        offsets = None if self.offsets is None else self.offsets[input_ids]
        rows = GroupedWeight(
            self.codes[input_ids], self.scales[input_ids], offsets, self.bits, self.group
        )
        return rows.dequantize(self.dtype)


def _embeddings(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """`(parent, attribute, embedding)` for every single-rank token embedding of `model`."""
    return [
        (parent, child, module)
        for parent in model.modules()
        for child, module in parent.named_children()
        if type(module) is nn.Embedding
        or (isinstance(module, VocabParallelEmbedding) and module.tp.size == 1)
    ]


def install_packed_weights(
    model: nn.Module,
    packed: dict[str, GroupedWeight],
    ops: MambaOps,
    method: str | None = None,
) -> PackedReport:
    """Puts the recorded integer layouts on the model's `Linear`s and token embeddings (see
    the module docstring); an LM head tied to the embedding gets the embedding's layout.

    Args:
        model: the model after `process_weights_after_loading`.
        packed: parameter name -> the layout of the tensor the loader copied into it.
        ops: the table whose `grouped_linear` / `int4_linear` the layers call.
        method: the load-time `quantization` asked for, if any ("w4a8" / "w4a8_k": the
            layouts those kernels take run with integer dots).

    Returns:
        The layers installed, their bytes, and the parameters left in float with why.
    """
    report = PackedReport()
    if not packed:
        return report
    drop_decode_plans(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    layouts = {id(params[n]): (n, lay) for n, lay in packed.items() if n in params}  # by object
    tables = {id(embedding.weight) for _, _, embedding in _embeddings(model)}
    done: set[str] = set()
    for module in model.modules():
        entry = layouts.get(id(module.weight)) if isinstance(module, Linear) else None
        if entry is None:
            continue
        name, layout = entry
        if not _matches(module.weight, layout):
            report.widened[name] = "the model transformed it after loading"
            continue
        dots = () if id(module.weight) in tables else _INT_DOT_LAYOUTS.get(method or "", ())
        install_packed(module, layout, ops, dots)  # a tied head: the embedding's layout
        done.add(name)
        report.installed += 1
        report.bytes_packed += layout.nbytes
    for parent, child, embedding in _embeddings(model):
        entry = layouts.get(id(embedding.weight))
        if entry is None or not _matches(embedding.weight, entry[1]):
            continue
        setattr(parent, child, GroupedEmbedding(entry[1], embedding.weight.dtype))
        done.add(entry[0])
    for name in packed:
        if name not in done and name not in report.widened:
            report.widened[name] = "not a Linear's or an embedding's weight"
    if report.widened:
        reasons: dict[str, int] = {}
        for why in report.widened.values():
            reasons[why] = reasons.get(why, 0) + 1
        logger.info(
            "Pre-quantised weights: %d layers keep their integer layout; %d tensors run in "
            "float (%s)",
            report.installed, len(report.widened),
            "; ".join(f"{count} {why}" for why, count in reasons.items()),
        )  # fmt: skip
    return report


def rows_of(tensor: torch.Tensor, index: slice | torch.Tensor) -> torch.Tensor:
    """`tensor[index]` (rows), keeping the attached integer layout's matching rows."""
    out = tensor[index]
    layout = packed_of(tensor)
    return attach_packed(out, layout.rows(index)) if layout is not None else out


def cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors stacked along rows; the integer layout kept when every part has one of the
    same kind (else the result is plain float)."""
    out = torch.cat(tensors)
    layouts = [packed_of(t) for t in tensors]
    if all(layout is not None for layout in layouts):
        kinds = {(layout.bits, layout.group) for layout in layouts}
        if len(kinds) == 1:
            return attach_packed(out, GroupedWeight.cat(layouts))
    return out
