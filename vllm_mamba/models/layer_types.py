"""The `layer_types` list of the hybrids that name each layer's kind in their config: one entry
per layer, checked once. The Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next, OLMo Hybrid) name
`linear_attention` (a GDN layer) or `full_attention`; LFM2 names `conv` (a short conv layer) or
`full_attention`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

LAYER_TYPES = ("linear_attention", "full_attention")


def layer_types(config: Any, kinds: Sequence[str] = LAYER_TYPES) -> list[str]:
    """The kind of each layer of `config`, each one of `kinds`.

    Raises:
        ValueError: the config has no `layer_types`, or the list does not name
            `num_hidden_layers` layers of `kinds`.
    """
    types = getattr(config, "layer_types", None)
    if types is None:
        raise ValueError(
            f"the config has no layer_types: it must name the kind of each of its "
            f"{config.num_hidden_layers} layers, each one of {tuple(kinds)}"
        )
    types = list(types)
    if len(types) != config.num_hidden_layers or not set(types) <= set(kinds):
        raise ValueError(
            f"layer_types must name {config.num_hidden_layers} layers, each one of "
            f"{tuple(kinds)}; got {types}"
        )
    return types
