"""How one GGUF architecture maps back onto a Hugging Face config and checkpoint names.

llama.cpp's converter (`convert_hf_to_gguf.py`) writes a Hugging Face checkpoint as GGUF: the
config becomes `<arch>.*` metadata keys and each tensor gets a GGUF name (`blk.3.ssm_in.weight`),
sometimes transformed (reshaped, split, merged, `A_log` written as `-exp(A_log)`, norms with a
+1 folded in). A `GGUFArchitecture` undoes that for one `general.architecture` value:

- `config(metadata)`: the `config.json` dict (with `architectures` and `model_type`) that the
  engine's model class for it reads; `metadata` maps every GGUF key to its Python value
  (strings, ints, floats, bools, lists).
- `tensors(name, tensor, config)`: for one GGUF tensor (its GGUF name, its values in PyTorch
  order as the converter read the Hugging Face tensor, float32 with its integer layout
  attached when the file keeps it quantised, see `vllm_mamba.layers.packed_weights`), the
  `(hugging_face_name, tensor)` pairs it stands for. Row selections and concatenations keep the
  integer layout with `packed_weights.rows_of` / `cat_rows`; any other transform gives a plain
  float tensor (the loader then runs that weight in float and says so).

Architectures register with `register_gguf_architecture`; `vllm_mamba.gguf.archs` holds the
built-in ones (imported by `gguf_architecture`).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GGUFArchitecture", "gguf_architecture", "register_gguf_architecture"]

ConfigFn = Callable[[dict[str, Any]], dict[str, Any]]
TensorsFn = Callable[[str, torch.Tensor, dict[str, Any]], Iterator[tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class GGUFArchitecture:
    """One `general.architecture` value and its mapping back (see the module docstring)."""

    name: str  # general.architecture, e.g. "mamba2"
    config: ConfigFn
    tensors: TensorsFn


_REGISTRY: dict[str, GGUFArchitecture] = {}
_loaded = False


def register_gguf_architecture(arch: GGUFArchitecture) -> None:
    """Registers (or replaces) the mapping of `arch.name`."""
    _REGISTRY[arch.name] = arch


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from vllm_mamba.gguf import archs

    for info in pkgutil.iter_modules(archs.__path__):
        importlib.import_module(f"{archs.__name__}.{info.name}")


def gguf_architecture(name: str) -> GGUFArchitecture:
    """The mapping of GGUF architecture `name`.

    Raises:
        ValueError: no mapping is registered for it (the supported ones named).
    """
    _load_builtin()
    arch = _REGISTRY.get(name)
    if arch is None:
        raise ValueError(
            f"GGUF general.architecture {name!r} is not supported; supported: "
            f"{', '.join(sorted(_REGISTRY))}"
        )
    return arch
