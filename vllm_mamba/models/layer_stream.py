"""Loads a model to be quantised one decoder layer at a time, so no float copy of the whole
model is ever resident.

A load-time quantisation (`quantization="int8"`, `"int4"`, ...) used to materialise the whole
float model, load it, then quantise: Qwen3.5-0.8B in float32 held 2.9 GiB of float weights to
end with 0.5 GiB of int4 ones. A `LayerStream` instead leaves each decoder layer on the meta
device until the first of its tensors arrives, and as soon as the last one has been copied it
runs the layer's `process_weights_after_loading`, quantises its `Linear`s and stacks its MoE
experts (`layers.moe.stack_experts`, a copy): the float layer and the experts' unstacked copies
are freed (and their pages returned: `malloc_trim`, as glibc keeps freed blocks between the
ones still in use) before the next is loaded. Checkpoints list their tensors by name, so a
layer's tensors arrive together and at most one float layer is resident at a time (in any
other order the result is the same; only the peak grows).

Finer units go the same way inside that: each expert of an `ExpertList` is materialised when
its first tensor arrives and quantised when its last has (a mixture-of-experts layer is mostly
experts: 1.6 GB of bfloat16 in a Qwen3.6-35B-A3B layer, so one float layer alone would be
more than the rest of the load holds), and so is an untied LM head (0.97 GB of bfloat16 at
Qwen3.6's 248,320 x 2,048, which checkpoints often list first). Quantising them early is the
same as at the end: no `process_weights_after_loading` touches an expert's or the head's
weights. What else is not in a decoder layer (the embedding, the final norm, a tied head, an
MTP head) is materialised up front and quantised at the end as before.

It applies (`LayerStream.of`) where nothing after loading needs the whole float model: one
rank, a float checkpoint (no pre-quantised or GGUF layouts, which are installed over the float
weights after loading), a model class that keeps `CausalLM`'s `process_weights_after_loading`,
and decoder layers that share no module with each other or with the rest of the model
(Zamba2's shared attention block is reused by several layers: loaded as before).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from vllm_mamba.layers.cache_layers import kv_cache_layers, stateful_layers
from vllm_mamba.layers.decode_plan import drop_decode_plans
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.moe import ExpertList, stack_experts
from vllm_mamba.layers.quantization import QuantizationReport
from vllm_mamba.worker.huge_pages import TRIM_BYTES, release_freed_heap


def to_empty(
    module: nn.Module, device: torch.device, recurse: bool = True, dtype: torch.dtype | None = None
) -> nn.Module:
    """`Module.to_empty` with plain `torch.empty` allocations: the parameters and buffers of
    `module` (and its children with `recurse`) on `device`, uninitialised, the floating ones in
    `dtype` when given (as `.to(dtype)` after it, without first allocating and converting
    them in their own dtype: that wrote every converted page, so an untied LM head and an
    embedding were resident, 0.97 GB each at Qwen3.6's shape, before their tensors arrived).
    (`to_empty`'s `empty_like` of a meta tensor runs through `torch._refs`, whose first call
    imports `torch.fx`'s symbolic shapes: a third of a second of every cold start.)"""

    def empty(t: torch.Tensor) -> torch.Tensor:
        kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return torch.empty(t.shape, dtype=kind, device=device)

    return module._apply(empty, recurse=recurse)


logger = logging.getLogger(__name__)

Quantize = Callable[[nn.Module, str], QuantizationReport]  # (module, its name in the model)


def process_layers(module: nn.Module, skip: set[int] | frozenset[int] = frozenset()) -> None:
    """Runs `process_weights_after_loading` of the recurrent and attention layers under
    `module` (the body of `CausalLM.process_weights_after_loading`), except those in `skip`
    (ids)."""
    for layer in [*stateful_layers(module), *kv_cache_layers(module)]:
        if id(layer) not in skip:
            layer.process_weights_after_loading()


class LayerStream:
    """The decoder layers of one model being loaded (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        layers: list[tuple[str, nn.Module]],
        device: torch.device,
        dtype: torch.dtype,
        quantize: Quantize,
    ) -> None:
        self.model, self.device, self.dtype, self.quantize = model, device, dtype, quantize
        self._prefixes = [(prefix + ".", layer) for prefix, layer in layers]
        self._inside = {id(m) for _, layer in layers for m in layer.modules()}
        # The experts inside the layers, under their names with a trailing dot (the untied LM
        # head joins them in `expect`, once the weights are tied)
        self._units = [
            (f"{prefix}.{name}.{i}.", expert)
            for prefix, layer in layers
            for name, experts in layer.named_modules()
            if isinstance(experts, ExpertList)
            for i, expert in enumerate(experts)
        ]
        self._in_units = {id(m) for _, unit in self._units for m in unit.modules()}
        self._pending: dict[int, set[str]] = {}  # layer or unit id -> its parameters not loaded
        self._live: set[int] = set()  # layers and units materialised
        self.reports: list[QuantizationReport] = []
        self._params: dict[str, nn.Parameter] = {}  # the loader's, by name (`expect`)
        self._freed = 0  # float bytes of the units quantised since the heap was last trimmed

    @staticmethod
    def of(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
        """The model's decoder layers under their names, or None where they cannot be loaded
        one at a time (see the module docstring)."""
        from vllm_mamba.models.causal_lm import CausalLM

        if type(model).process_weights_after_loading is not CausalLM.process_weights_after_loading:
            return None
        decoder = {id(layer) for layer in model.layers}
        layers = [(n, m) for n, m in model.named_modules() if id(m) in decoder]
        if len(layers) != len(model.layers):
            return None
        owner: dict[int, int] = {}
        for i, (_, layer) in enumerate(layers):
            for m in layer.modules():
                if owner.setdefault(id(m), i) != i:
                    return None  # a module shared by two layers
        inside = set(owner)
        for parent in model.modules():
            if id(parent) in inside:
                continue
            for child in parent.children():
                if id(child) in inside and not any(child is layer for _, layer in layers):
                    return None  # a module of a layer also held outside it
        return layers

    def materialize_rest(self) -> None:
        """Allocates every parameter and buffer outside the decoder layers (uninitialised, as
        `Module.to_empty`) in the model dtype; the layers stay on the meta device."""
        for module in self.model.modules():
            if id(module) not in self._inside:
                to_empty(module, self.device, recurse=False, dtype=self.dtype)

    def expect(self, params: dict[str, nn.Parameter]) -> None:
        """Records, from the loader's parameters by name, which each layer and unit waits for
        (the LM head is a unit when no other module holds its weight)."""
        self._params = params
        head = getattr(self.model, "lm_head", None)
        if isinstance(head, Linear) and "lm_head.weight" in params:
            holders = sum(
                p is head.weight for _, p in self.model.named_parameters(remove_duplicate=False)
            )
            if holders == 1:
                self._units.append(("lm_head.", head))
        for name in params:
            for _, owner in (self._layer_of(name), self._unit_of(name)):
                if owner is not None:
                    self._pending.setdefault(id(owner), set()).add(name)

    def _layer_of(self, name: str) -> tuple[str, nn.Module | None]:
        """The decoder layer holding parameter `name`, with its prefix; ("", None) if none."""
        return next(((p, m) for p, m in self._prefixes if name.startswith(p)), ("", None))

    def _unit_of(self, name: str) -> tuple[str, nn.Module | None]:
        """The unit holding parameter `name`, with its prefix; ("", None) if none."""
        return next(((p, m) for p, m in self._units if name.startswith(p)), ("", None))

    def param(self, name: str, params: dict[str, nn.Parameter]) -> nn.Parameter | None:
        """The live parameter `name`: a decoder layer's is materialised on first use, without
        its units, and a unit's with its own first use (the loader's `params` keep the meta
        ones, holding no float layer alive), else `params[name]`."""
        prefix, layer = self._layer_of(name)
        if layer is None:
            return params.get(name)
        if id(layer) not in self._live:
            for module in layer.modules():
                if id(module) not in self._in_units:
                    to_empty(module, self.device, recurse=False, dtype=self.dtype)
            self._live.add(id(layer))
        _, unit = self._unit_of(name)
        if unit is not None and id(unit) not in self._live:
            to_empty(unit, self.device, dtype=self.dtype)
            self._live.add(id(unit))
        return layer.get_parameter(name[len(prefix) :]) if name in params else None

    def loaded(self, name: str) -> None:
        """Marks `name` copied; the last parameter of a unit quantises it, the last of a layer
        processes and quantises the layer."""
        prefix, unit = self._unit_of(name)
        if unit is not None and self._done(unit, name):
            self._freed += sum(p.numel() * p.element_size() for p in unit.parameters())
            self.reports.append(self.quantize(unit, prefix[:-1]))
            if self._layer_of(name)[1] is None:  # the loader's names hold the quantised head
                for key in [k for k in self._params if k.startswith(prefix)]:
                    self._params[key] = unit.get_parameter(key[len(prefix) :])
            # The freed float units' pages back to the system: glibc keeps their blocks, which
            # the next units only partly reuse (a layer of 256 experts held 1.3 GB more than it
            # needed); `malloc_trim` for every unit would cost too much.
            if self._freed >= TRIM_BYTES:
                release_freed_heap()
                self._freed = 0
        prefix, layer = self._layer_of(name)
        if layer is not None and self._done(layer, name):
            drop_decode_plans(layer)
            process_layers(layer)
            self.reports.append(self.quantize(layer, prefix[:-1]))
            release_freed_heap()  # the float layer's pages back to the system
            # Its experts stacked now, while only this layer's quantised experts are copied (at
            # the end of the load every layer's would be, beside the freed ones still in the heap)
            stack_experts(layer)
            release_freed_heap()
            self._freed = 0

    def _done(self, owner: nn.Module, name: str) -> bool:
        """Marks `name` of `owner` (a layer or a unit) loaded; True when it was the last."""
        pending = self._pending.get(id(owner))
        if pending is None:
            return False
        pending.discard(name)
        if pending:
            return False
        del self._pending[id(owner)]
        return True

    def finish(self) -> None:
        """After loading: processes the layers outside the decoder layers (those inside were
        processed as they completed)."""
        drop_decode_plans(self.model)
        process_layers(self.model, skip=self._inside)
