"""The `layer_types` list of the Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next, OLMo Hybrid): one
entry per layer, `linear_attention` (a GDN layer) or `full_attention`, checked once."""

from __future__ import annotations

from typing import Any

LAYER_TYPES = ("linear_attention", "full_attention")


def layer_types(config: Any) -> list[str]:
    """The kind of each layer of `config`.

    Raises:
        ValueError: the list does not name `num_hidden_layers` layers of the known kinds.
    """
    types = list(config.layer_types)
    if len(types) != config.num_hidden_layers or not set(types) <= set(LAYER_TYPES):
        raise ValueError(
            f"layer_types must name {config.num_hidden_layers} layers, each one of "
            f"{LAYER_TYPES}; got {types}"
        )
    return types
