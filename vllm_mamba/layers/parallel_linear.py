"""Tensor-parallel linear layers, embedding and LM head, and how each rank reads its slices.

With one rank every factory returns the plain layer (`Linear`, `nn.Embedding`), so a model
built for one rank is exactly the single-process model. With `N` ranks:

- `ColumnParallelLinear`: the output features are sections (Mamba's x and z halves), each
  split evenly or by explicit ranges; no communication.
- `RowParallelLinear`: the input features are split; the partial products are all-reduced,
  then the bias is added once.
- `VocabParallelEmbedding`: each rank holds `ceil(V / N)` rows (the last padded with zeros);
  the lookups outside a rank's rows are zero and the sum over ranks is the embedding.
- `ParallelLMHead`: each rank scores its vocabulary rows; the logits are all-gathered.

A sharded parameter has a `Shard` in its module's `tp_shards` (by parameter name; kept on the
module because materialising a meta model replaces the parameters): the global shape and the
ranges of one dimension that make up this rank's tensor. `Shard.read` takes them from a full
tensor or from a safetensors slice (reading only those bytes), so each rank holds about 1/N of
the weights.

Glossary: T tokens, H hidden size, V vocabulary, N ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm_mamba.distributed.communication import all_gather, all_reduce, all_reduce_max
from vllm_mamba.distributed.parallel_state import TensorParallel
from vllm_mamba.layers.linear import Linear
from vllm_mamba.ops.int_dot_linear import GROUP_BYTES, strip_rows
from vllm_mamba.ops.table import MambaOps

Ranges = list[tuple[int, int]]  # (start, length) along the sharded dimension


@dataclass(frozen=True)
class Shard:
    """This rank's part of a parameter: `ranges` of dimension `dim` of the global tensor,
    concatenated; rows past the global size (vocabulary padding) are zeros."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    global_shape: tuple[int, ...]

    def read(self, source: Any, name: str) -> torch.Tensor:
        """This rank's tensor from `source`: a tensor or a safetensors slice of the global one.

        Raises:
            ValueError: the checkpoint tensor `name` does not have the global shape.
        """
        shape = tuple(source.get_shape() if hasattr(source, "get_shape") else source.shape)
        if shape != self.global_shape:
            raise ValueError(
                f"{name}: checkpoint {shape}, model {self.global_shape} (before sharding)"
            )
        parts = []
        size = self.global_shape[self.dim]
        for start, length in self.ranges:
            end = min(start + length, size)
            index = (slice(None),) * self.dim + (slice(start, end),)
            part = source[index]
            if end - start < length:  # vocabulary padding of the last rank
                pad = list(part.shape)
                pad[self.dim] = length - max(end - start, 0)
                part = torch.cat([part, part.new_zeros(pad)], dim=self.dim)
            parts.append(part)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def shard_param(module: nn.Module, name: str, dim: int, ranges: Ranges, global_size: int) -> None:
    """Marks parameter `name` of `module` as this rank's `ranges` of dimension `dim` (of
    `global_size`)."""
    shape = list(getattr(module, name).shape)
    assert shape[dim] == sum(n for _, n in ranges), (shape, ranges)
    shape[dim] = global_size
    if "tp_shards" not in module.__dict__:
        module.tp_shards = {}
    module.tp_shards[name] = Shard(dim, tuple(ranges), tuple(shape))


def named_shards(model: nn.Module) -> dict[str, Shard]:
    """The `Shard` of every sharded parameter of `model`, by its full name."""
    return {
        f"{prefix}.{name}" if prefix else name: shard
        for prefix, module in model.named_modules()
        for name, shard in module.__dict__.get("tp_shards", {}).items()
    }


def even_ranges(sections: list[int], tp: TensorParallel, what: str) -> Ranges:
    """Global `(start, length)` of this rank's even share of each consecutive section."""
    ranges, offset = [], 0
    for size in sections:
        start, length = tp.range(size, what)
        ranges.append((offset + start, length))
        offset += size
    return ranges


class ColumnParallelLinear(Linear):
    """`Linear` holding output features `out_ranges` of `out_features` (and their bias)."""

    def __init__(
        self, in_features: int, out_features: int, out_ranges: Ranges, bias: bool, ops: MambaOps
    ) -> None:
        super().__init__(in_features, sum(n for _, n in out_ranges), bias, ops)
        shard_param(self, "weight", 0, out_ranges, out_features)
        if self.bias is not None:
            shard_param(self, "bias", 0, out_ranges, out_features)


class RowParallelLinear(Linear):
    """`Linear` over this rank's input features; the partial outputs are summed over ranks
    (or, with `reduce=False`, left for the caller to sum once: the bias is then rank 0's)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        ops: MambaOps,
        tp: TensorParallel,
        reduce: bool = True,
    ) -> None:
        start, length = tp.range(in_features, "input features of a row-parallel layer")
        super().__init__(length, out_features, bias, ops)
        self.tp = tp
        self.reduce = reduce
        shard_param(self, "weight", 1, [(start, length)], in_features)

    def row_absmax(self) -> torch.Tensor:
        """`(out,)` float32: the largest `|w|` of each whole row (over every rank's columns), so
        that int8 quantisation scales the rows as one rank would."""
        absmax = self.weight.detach().float().abs().amax(dim=1)  # (out,)
        return all_reduce_max(absmax, self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, in / N)` -> `(T, out)`: the same on every rank, or this rank's part."""
        y = self.linear_op(x, self.weight, None)  # (T, out)
        if self.reduce:
            y = all_reduce(y, self.tp)
        elif self.tp.rank != 0:
            return y
        return y if self.bias is None else y + self.bias


def column_linear(
    in_features: int,
    sections: list[int],
    bias: bool,
    ops: MambaOps,
    tp: TensorParallel,
    ranges: Ranges | None = None,
) -> Linear:
    """A `Linear` whose outputs are `sections`, each split evenly over the ranks (or this
    rank's explicit global `ranges`); the plain `Linear` with one rank."""
    if tp.size == 1:
        return Linear(in_features, sum(sections), bias, ops)
    ranges = ranges if ranges is not None else even_ranges(sections, tp, "output features")
    return ColumnParallelLinear(in_features, sum(sections), ranges, bias, ops)


def row_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    ops: MambaOps,
    tp: TensorParallel,
    reduce: bool = True,
) -> Linear:
    """A row-parallel `Linear` (`reduce=False`: the caller sums the ranks' outputs); the
    plain `Linear` with one rank."""
    if tp.size == 1:
        return Linear(in_features, out_features, bias, ops)
    return RowParallelLinear(in_features, out_features, bias, ops, tp, reduce)


def vocab_range(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """`(start, rows)` of this rank's vocabulary shard (`ceil(V / N)` rows, padded)."""
    rows = math.ceil(vocab_size / tp.size)
    return tp.rank * rows, rows


class VocabParallelEmbedding(nn.Module):
    """This rank's `ceil(V / N)` embedding rows; the lookup is summed over ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.start, rows = vocab_range(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.strips = False  # `use_int8_table` with an integer-dot (strip layout) table
        shard_param(self, "weight", 0, [(self.start, rows)], vocab_size)

    def use_int8_table(
        self, weight: nn.Parameter, scale: torch.Tensor, dtype: torch.dtype, strips: bool = False
    ) -> None:
        """Reads the tied LM head's int8 rows `weight` with their `scale (rows,)` instead
        (`strips`: stored in the integer-dot strip layout)."""
        self.weight = weight
        self.register_buffer("weight_scale", scale)
        self.dtype = dtype
        self.strips = strips

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids (T,)` -> `(T, H)`, the same on every rank."""
        local = input_ids - self.start  # (T,)
        outside = (local < 0) | (local >= self.weight.shape[0])
        local = local.masked_fill(outside, 0)
        if self.strips:
            hidden = strip_rows(self.weight, local, GROUP_BYTES)  # (T, H) int8
        else:
            hidden = nn.functional.embedding(local, self.weight)  # (T, H)
        if hidden.dtype == torch.int8:
            hidden = (hidden.float() * self.weight_scale[local, None]).to(self.dtype)
        hidden = hidden.masked_fill(outside[:, None], 0)
        return all_reduce(hidden, self.tp)


class ParallelLMHead(Linear):
    """This rank's `ceil(V / N)` vocabulary rows of the LM head; logits all-gathered."""

    def __init__(
        self, hidden_size: int, vocab_size: int, ops: MambaOps, tp: TensorParallel
    ) -> None:
        start, rows = vocab_range(vocab_size, tp)
        super().__init__(hidden_size, rows, False, ops)
        self.tp = tp
        self.vocab_size = vocab_size
        shard_param(self, "weight", 0, [(start, rows)], vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (R, H)` -> logits `(R, V)` over the whole vocabulary, on every rank."""
        local = self.linear_op(x, self.weight, None)  # (R, V / N)
        return all_gather(local, self.tp, dim=-1)[:, : self.vocab_size]


def vocab_embedding(vocab_size: int, hidden_size: int, tp: TensorParallel) -> nn.Module:
    """The token embedding: `nn.Embedding` with one rank, else vocabulary-parallel."""
    if tp.size == 1:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, tp)


def lm_head(hidden_size: int, vocab_size: int, ops: MambaOps, tp: TensorParallel) -> Linear:
    """The LM head: the plain `Linear` with one rank, else vocabulary-parallel."""
    if tp.size == 1:
        return Linear(hidden_size, vocab_size, False, ops)
    return ParallelLMHead(hidden_size, vocab_size, ops, tp)
