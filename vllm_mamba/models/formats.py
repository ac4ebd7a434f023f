"""Checkpoint formats: how a model directory is recognised, read into a Hugging Face style
config, and how its tensors are read and named, so the loader knows no format but this
interface.

A `CheckpointFormat` declares:

- `detect(path, raw)`: whether the directory `path` (with its parsed `config.json` as `raw`,
  None when there is none) is in this format;
- `load_config(path, raw)`: the transformers-style config (with `architectures`) that picks the
  model class from `ModelRegistry`;
- `weights(path, lazy)`: the checkpoint's `(name, tensor)` pairs (the Hugging Face files by
  default: `model.safetensors`, sharded safetensors with their index, `pytorch_model.bin`);
- `convert_weight(name, tensor)`: one checkpoint tensor under the model class's names and
  shapes (identity by default), applied before the class's own `expand_weight`;
- `default_tokenizer`: the hub id of the tokenizer to use when the directory ships none.

The registry tries the registered formats in order (the built-in ones: the original mamba-ssm
format, BlinkDL's RWKV-7 `.pth`, GGUF; plugins' after them, or first with `first=True`) and falls
back to the Hugging Face format (`HF_FORMAT`) when a `config.json` is there. A built-in format
is named by a `"module:ATTRIBUTE"` reference and imported on first use.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "CheckpointFormat",
    "HF_FORMAT",
    "HuggingFaceFormat",
    "detect_format",
    "read_config_json",
    "registered_formats",
    "register_format",
]

CONFIG_FILE = "config.json"


def read_config_json(path: str) -> dict[str, Any] | None:
    """The parsed `config.json` of the directory `path`; None when there is none.

    Raises:
        ValueError: it is not valid JSON, or not an object.
    """
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{file} is not valid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{file} is not a JSON object")
    return raw


def hf_weight_files(path: str) -> tuple[list[str], str] | None:
    """The Hugging Face weight files of `path` and their kind (`safetensors` or `bin`): the
    shards of an index, else the single file; None when there are none."""
    for index_name, kind in (
        ("model.safetensors.index.json", "safetensors"),
        ("pytorch_model.bin.index.json", "bin"),
    ):
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(path, s) for s in shards], kind
    for name, kind in (("model.safetensors", "safetensors"), ("pytorch_model.bin", "bin")):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            return [file], kind
    return None


class CheckpointFormat:
    """A checkpoint layout (see the module docstring); subclasses override what differs from
    the Hugging Face one."""

    name: str = "hf"
    description: str = "Hugging Face (config.json; safetensors or pytorch_model.bin)"
    default_tokenizer: str | None = None

    def detect(self, path: str, raw: dict[str, Any] | None) -> bool:
        """Whether the directory `path` (parsed `config.json` `raw`, or None) is this format."""
        raise NotImplementedError

    def load_config(self, path: str, raw: dict[str, Any] | None) -> Any:
        """The transformers-style config of the checkpoint (`architectures` set)."""
        raise NotImplementedError

    def weight_files(self, path: str) -> tuple[list[str], str]:
        """The files holding the tensors and their kind (`safetensors`, `bin` or the format's
        own), for `weights`.

        Raises:
            FileNotFoundError: the directory holds no weights of this format.
        """
        found = hf_weight_files(path)
        if found is None:
            raise FileNotFoundError(
                f"no weights in {path!r}: expected model.safetensors, sharded safetensors with "
                "model.safetensors.index.json, or pytorch_model.bin"
            )
        return found

    def read_file(self, file: str, kind: str, lazy: bool) -> Iterator[tuple[str, Any]]:
        """The `(name, tensor)` pairs of one weight file. With `lazy`, safetensors tensors
        come as slices (read on indexing), so a rank reads only its part of a sharded
        parameter."""
        if kind == "safetensors" and not lazy and sys.byteorder == "little":
            from vllm_mamba.models.safetensors_reader import read_safetensors

            yield from read_safetensors(file)  # no memory map: see that module
        elif kind == "safetensors":
            from safetensors import safe_open

            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_slice(name) if lazy else f.get_tensor(name)
        elif kind == "bin":
            yield from torch.load(file, map_location="cpu", weights_only=True).items()
        else:
            raise ValueError(f"{self.name}: unknown weight file kind {kind!r} of {file!r}")

    def convert_weight(self, name: str, tensor: Any) -> list[tuple[str, Any]]:
        """One checkpoint tensor under the model class's names and shapes (itself here)."""
        return [(name, tensor)]


class HuggingFaceFormat(CheckpointFormat):
    """The Hugging Face layout: `config.json` read by `AutoConfig` (a model type transformers
    does not know gets its config class from `ModelRegistry.register_config`)."""

    def detect(self, path: str, raw: dict[str, Any] | None) -> bool:
        return raw is not None

    def load_config(self, path: str, raw: dict[str, Any] | None) -> Any:
        from huggingface_hub.errors import StrictDataclassError
        from transformers import AutoConfig

        from vllm_mamba.models.registry import ModelRegistry

        model_type = raw.get("model_type") if raw is not None else None
        if isinstance(model_type, str):
            config_cls = ModelRegistry.resolve_config_cls(model_type)
            if config_cls is not None:  # a model type transformers does not know
                AutoConfig.register(model_type, config_cls, exist_ok=True)
        try:
            return AutoConfig.from_pretrained(path)
        except StrictDataclassError as err:  # a validator's error, wrapped: not a ValueError
            raise ValueError(f"config.json of {path!r} is invalid: {err.__cause__ or err}") from err


HF_FORMAT = HuggingFaceFormat()

_BUILTIN_FORMATS: list[str] = [
    "vllm_mamba.models.mamba_ssm_format:FORMAT",
    "vllm_mamba.models.rwkv_pth_format:FORMAT",
    "vllm_mamba.gguf.format:FORMAT",
]
_formats: list[CheckpointFormat | str] = list(_BUILTIN_FORMATS)
_imported: dict[str, CheckpointFormat] = {}  # reference -> the format it named


def _load(entry: CheckpointFormat | str) -> CheckpointFormat:
    if isinstance(entry, CheckpointFormat):
        return entry
    fmt = _imported.get(entry)
    if fmt is None:
        module_name, attr = entry.split(":")
        fmt = getattr(importlib.import_module(module_name), attr)
        if not isinstance(fmt, CheckpointFormat):
            raise TypeError(f"checkpoint format {entry!r} is {fmt!r}, not a CheckpointFormat")
        _imported[entry] = fmt
    return fmt


def register_format(fmt: CheckpointFormat | str, *, first: bool = False) -> None:
    """Adds a checkpoint format (a plugin's), tried after the registered ones (before them
    with `first`) and always before the Hugging Face fallback.

    Args:
        fmt: the format, or `"package.module:ATTRIBUTE"` naming one, imported on first use.

    Raises:
        ValueError: a reference without `:`, or a format whose name is already registered.
    """
    if isinstance(fmt, str):
        if ":" not in fmt:
            raise ValueError(f"format {fmt!r} must look like 'package.module:ATTRIBUTE'")
        if fmt in _formats:
            raise ValueError(f"checkpoint format {fmt!r} is already registered")
    else:
        if not isinstance(fmt, CheckpointFormat):
            raise TypeError(f"{fmt!r} is not a CheckpointFormat")
        names = {f.name for f in registered_formats()} | {HF_FORMAT.name}
        if fmt.name in names:
            raise ValueError(f"a checkpoint format named {fmt.name!r} is already registered")
    if first:
        _formats.insert(0, fmt)
    else:
        _formats.append(fmt)


def registered_formats() -> list[CheckpointFormat]:
    """The registered formats in the order they are tried (the Hugging Face fallback not
    included)."""
    return [_load(f) for f in _formats]


def detect_format(path: str, raw: dict[str, Any] | None = None) -> CheckpointFormat:
    """The format of the model directory `path`.

    Args:
        raw: its parsed `config.json` if already read (read here otherwise).

    Raises:
        FileNotFoundError: no format recognises it and there is no `config.json` (the message
            names the formats tried).
        ValueError: a format recognised it but refuses it (e.g. several `.pth` files).
    """
    if raw is None:
        raw = read_config_json(path)
    for fmt in registered_formats():
        if fmt.detect(path, raw):
            return fmt
    if HF_FORMAT.detect(path, raw):
        return HF_FORMAT
    tried = "; ".join(f.description for f in registered_formats())
    raise FileNotFoundError(
        f"no config.json in model directory {path!r}, and no other checkpoint format "
        f"recognised it (tried: {tried})"
    )
