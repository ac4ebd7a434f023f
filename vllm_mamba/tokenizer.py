"""Finds and loads the tokenizer of a model.

The tokenizer comes from the `tokenizer` argument, else from the model directory. A
checkpoint format may name the tokenizer its checkpoints use without shipping it
(`CheckpointFormat.default_tokenizer`: mamba-ssm's use the GPT-NeoX-20B tokenizer, taken from
the hub or its cache, as mamba-ssm's own README does).
RWKV checkpoints without a `tokenizer.json` but with an `rwkv_vocab_*.txt` file use the RWKV
World tokenizer of `vllm_mamba.rwkv_world_tokenizer` (fla-hub's remote-code tokenizer class
named in `tokenizer_config.json` is never run).
A GGUF model (a `.gguf` file, or a directory holding one and no tokenizer files) uses the
tokenizer the file carries (`vllm_mamba.gguf.tokenizer`).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_CACHE_SIZE = 4  # tokenizers kept by `cached_tokenizer`
_cache: OrderedDict[tuple, Any] = OrderedDict()
_cache_lock = threading.Lock()


def default_tokenizer_source(model_path: str) -> str | None:
    """The hub id of the tokenizer a tokenizer-less checkpoint needs (its format's
    `default_tokenizer`, e.g. mamba-ssm's), else None."""
    from vllm_mamba.rwkv_world_tokenizer import find_vocab_file

    if find_vocab_file(model_path) is not None:
        return None
    if any(os.path.isfile(os.path.join(model_path, f)) for f in _TOKENIZER_FILES):
        return None
    from vllm_mamba.models.formats import detect_format

    try:
        return detect_format(model_path).default_tokenizer
    except (OSError, ValueError):
        return None


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from the directory `path`: its `tokenizer.json` (or other
    transformers tokenizer files), else the RWKV World tokenizer of its `rwkv_vocab_*.txt`.

    Raises:
        FileNotFoundError: no tokenizer files are there.
    """
    from transformers import AutoTokenizer

    from vllm_mamba.rwkv_world_tokenizer import RwkvWorldTokenizer, find_vocab_file

    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        from vllm_mamba.gguf.format import gguf_file_of, open_gguf

        gguf_file = gguf_file_of(path)
        if gguf_file is not None:
            from vllm_mamba.gguf.tokenizer import gguf_tokenizer

            return gguf_tokenizer(open_gguf(gguf_file).metadata)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")) and find_vocab_file(path):
        return RwkvWorldTokenizer.from_directory(path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(
            f"no usable tokenizer in {path!r} (it needs a tokenizer.json or other transformers "
            f"tokenizer files, or an RWKV World vocabulary rwkv_vocab_*.txt): {err}"
        ) from err


def _signature(path: str) -> tuple:
    """What identifies the tokenizer files of `path` (a directory or a file): the real path
    and each file's name, size and modification time."""
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        try:
            stat = os.stat(real)
        except OSError:
            return (real,)
        return (real, stat.st_size, stat.st_mtime_ns)
    entries = []
    for entry in sorted(os.scandir(real), key=lambda e: e.name):
        if entry.is_file():
            stat = entry.stat()
            entries.append((entry.name, stat.st_size, stat.st_mtime_ns))
    return (real, tuple(entries))


def cached_tokenizer(path: str) -> Any:
    """`load_tokenizer(path)`, shared by the engines of one process while the files are
    unchanged (the engine never modifies its tokenizer; parsing a 50k-token vocabulary was
    most of a tiny model's start-up, about 2 s of 2.6 under load). The last few are kept."""
    key = _signature(path)
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    tokenizer = load_tokenizer(path)
    with _cache_lock:
        _cache[key] = tokenizer
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return tokenizer
