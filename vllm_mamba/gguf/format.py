"""GGUF as a checkpoint format: `LLM(model="file.gguf")`, a directory holding one GGUF (or one
split set), `vllm-mamba serve file.gguf`.

- **Detect**: a `.gguf` file path, or a directory without `config.json` holding `.gguf` files
  of one model.
- **Config**: `general.architecture` picks the mapping (`vllm_mamba.gguf.arch`); its `config`
  gets the metadata plus the tensor names and shapes (`vllm_mamba.gguf.metadata`); then
  `vocab_size` is the rows of `token_embd.weight`, `tie_word_embeddings` whether the file has
  no `output.weight`, and `dtype` float32 when every tensor of 2 or more dimensions is
  F32, else bfloat16 (F16 / BF16 / quantised files run in bfloat16 by default; `dtype=`
  overrides). `gguf_file_types` records the block types and their tensor counts.
- **Weights**: each tensor decoded by `vllm_mamba.gguf.blocks` (Q4_0 / Q4_1 / Q5_0 / Q5_1 /
  Q8_0 / Q4_K / Q5_K / Q6_K keep their exact integer layout; F32 / F16 / BF16 as they are),
  then named back by the architecture's `tensors`. A file with another block type is refused
  when its config is read (a ValueError naming the tensor and type: dequantising it to float
  would silently multiply its memory).
- `quantization=` with a quantised GGUF: the file's integer layers stay as they are; the
  load-time quantisation applies to the layers the file stores in float (`quantize_model`
  skips integer layers). Under `"w4a8"` / `"w4a8_k"` the file's Q4_0 layers, and under
  `"w4a8_k"` its Q4_K ones, multiply with integer dot products on their own codes
  (`layers.packed_weights`). Tensor parallelism (more than one rank) with a quantised GGUF is a
  ValueError: integer layouts load on one rank.
- **Tokenizer**: the file's own (`vllm_mamba.gguf.tokenizer`), unless `tokenizer=` is given.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

from vllm_mamba.gguf.reader import GGUFFile, find_gguf_files
from vllm_mamba.models.formats import CheckpointFormat

__all__ = ["FORMAT", "GGUFFormat", "gguf_file_of", "open_gguf"]


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime: float) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(file: str) -> GGUFFile:
    """The parsed GGUF `file` (cached while the file is unchanged)."""
    return _open(os.path.abspath(file), os.path.getmtime(file))


def gguf_file_of(path: str) -> str | None:
    """The first GGUF file of model `path` (a `.gguf` file or a directory without
    `config.json`), else None."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return None
    files = find_gguf_files(path)
    return files[0] if files else None


def _config_dict(gguf: GGUFFile) -> dict[str, Any]:
    from vllm_mamba.gguf.arch import gguf_architecture
    from vllm_mamba.gguf.blocks import FLOAT_TYPES, KEPT_TYPES
    from vllm_mamba.gguf.metadata import TENSOR_NAMES, TENSOR_SHAPES

    for t in gguf.tensors:
        if t.type_name not in FLOAT_TYPES + KEPT_TYPES:
            raise ValueError(
                f"GGUF tensor {t.name}: block type {t.type_name} is not supported (kept as "
                f"integers: {', '.join(KEPT_TYPES)}; float: {', '.join(FLOAT_TYPES)}); convert "
                "the model with one of those types"
            )
    shapes = gguf.tensor_shapes()
    arch = gguf_architecture(gguf.architecture)
    metadata = {**gguf.metadata, TENSOR_SHAPES: shapes, TENSOR_NAMES: frozenset(shapes)}
    config = dict(arch.config(metadata))
    if "token_embd.weight" in shapes:
        config["vocab_size"] = int(shapes["token_embd.weight"][0])
        config["tie_word_embeddings"] = "output.weight" not in shapes
    all_f32 = all(t.type_name == "F32" for t in gguf.tensors if len(t.shape) >= 2)
    config["dtype"] = "float32" if all_f32 else "bfloat16"
    config["gguf_file_types"] = dict(Counter(t.type_name for t in gguf.tensors))
    return config


class GGUFFormat(CheckpointFormat):
    """llama.cpp's GGUF files (see the module docstring)."""

    name = "gguf"
    description = "GGUF (a .gguf file, a split set, or a directory holding one)"

    def detect(self, path: str, raw: dict[str, Any] | None) -> bool:
        return raw is None and gguf_file_of(path) is not None

    def config_dict(self, path: str) -> dict[str, Any]:
        """The `config.json` dict of the GGUF model at `path`."""
        file = gguf_file_of(path)
        if file is None:
            raise FileNotFoundError(f"no GGUF file at {path!r}")
        return _config_dict(open_gguf(file))

    def load_config(self, path: str, raw: dict[str, Any] | None) -> Any:
        from transformers import CONFIG_MAPPING

        from vllm_mamba.models.registry import ModelRegistry

        config = self.config_dict(path)
        model_type = config["model_type"]
        config_cls = ModelRegistry.resolve_config_cls(model_type)
        if config_cls is None:
            config_cls = CONFIG_MAPPING[model_type]
        return config_cls.from_dict(config)

    def weight_files(self, path: str) -> tuple[list[str], str]:
        file = gguf_file_of(path)
        if file is None:
            raise FileNotFoundError(f"no GGUF file at {path!r}")
        return [file], "gguf"

    def read_file(self, file: str, kind: str, lazy: bool) -> Iterator[tuple[str, Any]]:
        """Every tensor of the GGUF model (all its split parts) under Hugging Face names.

        Raises:
            ValueError: `lazy` (tensor parallelism) with a quantised tensor.
        """
        from vllm_mamba.gguf.arch import gguf_architecture
        from vllm_mamba.gguf.blocks import FLOAT_TYPES, decode_tensor

        gguf = GGUFFile(file)  # not the cached one: its mapping goes once the weights are read
        config = _config_dict(gguf)
        arch = gguf_architecture(gguf.architecture)
        for t in gguf.tensors:
            if lazy and t.type_name not in FLOAT_TYPES:
                raise ValueError(
                    f"GGUF tensor {t.name} is {t.type_name}: a quantised GGUF loads on one rank "
                    "only (tensor_parallel_size 1)"
                )
            tensor = decode_tensor(t.name, t.type_name, t.shape, t.data)
            yield from arch.tensors(t.name, tensor, config)


FORMAT = GGUFFormat()
