"""Loads a model to be quantised one decoder layer at a time, so no float copy of the whole
model is ever resident.

A load-time quantisation (`quantization="int8"`, `"int4"`, ...) used to materialise the whole
float model, load it, then quantise: Qwen3.5-0.8B in float32 held 2.9 GiB of float weights to
end with 0.5 GiB of int4 ones. A `LayerStream` instead leaves each decoder layer on the meta
device until the first of its tensors arrives, and as soon as the last one has been copied it
runs the layer's `process_weights_after_loading` and quantises its `Linear`s: the float layer
is freed (and its pages returned: `malloc_trim`, as glibc keeps freed blocks between the ones
still in use) before the next is loaded. Checkpoints list their tensors by name, so a layer's
tensors arrive together and at most one float layer is resident at a time (in any other order
the result is the same; only the peak grows). What is not in a decoder layer (the embedding,
the final norm, the LM head, an MTP head) is materialised up front and quantised at the end as
before.

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
from vllm_mamba.layers.quantization import QuantizationReport
from vllm_mamba.worker.huge_pages import release_freed_heap


def to_empty(module: nn.Module, device: torch.device, recurse: bool = True) -> nn.Module:
    """`Module.to_empty` with plain `torch.empty` allocations: the parameters and buffers of
    `module` (and its children with `recurse`) on `device`, uninitialised. (`to_empty`'s
    `empty_like` of a meta tensor runs through `torch._refs`, whose first call imports
    `torch.fx`'s symbolic shapes: a third of a second of every cold start.)"""
    return module._apply(
        lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), recurse=recurse
    )


logger = logging.getLogger(__name__)

Quantize = Callable[[nn.Module], QuantizationReport]


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
        self._pending: dict[int, set[str]] = {}  # layer id -> its parameters not yet loaded
        self._live: set[int] = set()  # layers materialised
        self.reports: list[QuantizationReport] = []

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
                to_empty(module, self.device, recurse=False)
        self.model.to(self.dtype)  # meta tensors stay meta

    def expect(self, params: dict[str, nn.Parameter]) -> None:
        """Records, from the loader's parameters by name, which each layer waits for."""
        for name in params:
            layer = self._layer_of(name)
            if layer is not None:
                self._pending.setdefault(id(layer), set()).add(name)

    def _layer_of(self, name: str) -> nn.Module | None:
        return next((layer for p, layer in self._prefixes if name.startswith(p)), None)

    def param(self, name: str, params: dict[str, nn.Parameter]) -> nn.Parameter | None:
        """The live parameter `name`: a decoder layer's is materialised on first use (the
        loader's `params` keep the meta ones, holding no float layer alive), else
        `params[name]`."""
        layer = self._layer_of(name)
        if layer is None:
            return params.get(name)
        if id(layer) not in self._live:
            to_empty(layer, self.device).to(self.dtype)
            self._live.add(id(layer))
        prefix = next(p for p, m in self._prefixes if m is layer)
        return layer.get_parameter(name[len(prefix) :]) if name in params else None

    def loaded(self, name: str) -> None:
        """Marks `name` copied; the last parameter of a layer processes and quantises it."""
        layer = self._layer_of(name)
        if layer is None:
            return
        pending = self._pending.get(id(layer))
        if pending is None:
            return
        pending.discard(name)
        if not pending:
            del self._pending[id(layer)]
            drop_decode_plans(layer)
            process_layers(layer)
            self.reports.append(self.quantize(layer))
            release_freed_heap()  # the float layer's pages back to the system

    def finish(self) -> None:
        """After loading: processes the layers outside the decoder layers (those inside were
        processed as they completed)."""
        drop_decode_plans(self.model)
        process_layers(self.model, skip=self._inside)
