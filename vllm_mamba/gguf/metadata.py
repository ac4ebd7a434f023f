"""Helpers the architecture mappings share to read GGUF metadata back into config values.

`GGUFFormat` adds two keys of its own to the metadata an architecture's `config` gets, for
the config values that only the tensors tell (biases present, a tied head):
`TENSOR_SHAPES` (`"vllm_mamba.tensor_shapes"`), GGUF tensor name -> shape in PyTorch order, and
`TENSOR_NAMES` (`"gguf.tensor_names"`), the frozenset of the names. It also sets
`vocab_size` (the rows of `token_embd.weight`) and `tie_word_embeddings` (no `output.weight`)
on every architecture's config, and the special token ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "TENSOR_NAMES",
    "TENSOR_SHAPES",
    "arch_value",
    "decimal",
    "has_tensor",
    "special_token_ids",
]

TENSOR_SHAPES = "vllm_mamba.tensor_shapes"
TENSOR_NAMES = "gguf.tensor_names"


def decimal(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (`1e-05`, not
    `9.999999747378752e-06`): the config value the converter read."""
    return float(str(np.float32(value)))


def arch_value(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    """`<general.architecture>.<key>`, else `default`.

    Raises:
        ValueError: the key is missing and there is no default (named).
    """
    full = f"{metadata['general.architecture']}.{key}"
    if full in metadata:
        return metadata[full]
    if default is None:
        raise ValueError(f"GGUF metadata {full} is missing")
    return default


def has_tensor(metadata: dict[str, Any], name: str) -> bool:
    """Whether the file holds GGUF tensor `name`."""
    return name in metadata.get(TENSOR_SHAPES, {})


def special_token_ids(metadata: dict[str, Any]) -> dict[str, int]:
    """`bos_token_id`, `eos_token_id`, `pad_token_id` from `tokenizer.ggml.*` (those set)."""
    keys = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
            "pad_token_id": "padding_token_id"}  # fmt: skip
    return {
        ours: int(metadata[f"tokenizer.ggml.{theirs}"])
        for ours, theirs in keys.items()
        if isinstance(metadata.get(f"tokenizer.ggml.{theirs}"), int)
    }
