"""Reading GGUF files: one `.gguf`, or a split set found from any of its parts.

A GGUF file holds metadata (`key -> value`) and tensors, each with a block type
(`F32`, `Q8_0`, `Q4_K`, ...) and its dimensions written innermost first. `GGUFFile` parses them
itself (the header by the format's specification, the tensors memory-mapped: nothing is read
until a tensor's blocks are used; the `gguf` package gives the block sizes) and gives:

- `metadata`: every key's Python value (strings, ints, floats, bools, lists) over all parts
  (the split bookkeeping keys `split.*` dropped);
- `tensors`: `GGUFTensor`s in file order, their `shape` in PyTorch order (GGUF's reversed)
  and `data` the raw blocks as `gguf` maps them (`(rows..., bytes per row)` uint8 for block
  types, the element dtype for float ones, BF16 as uint16).

The header is parsed here rather than by `gguf.GGUFReader`, which builds a numpy view per
array item: 6.8 s for a GPT-NeoX vocabulary's 50k tokens and merges on a loaded 2-core
machine, against 0.1 s here.

A split set (`name-00001-of-00003.gguf`, ... as llama.cpp's `gguf-split` writes it) is read
from any of its parts: every part must be there, next to it.
"""

from __future__ import annotations

import glob
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["GGUFFile", "GGUFTensor", "find_gguf_files", "read_gguf", "split_parts"]

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_PROJECTOR_PREFIX = "mmproj"  # llama.cpp's image projectors, shipped beside the model


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, not yet decoded."""

    name: str  # GGUF name, e.g. "blk.0.ssm_in.weight"
    type_name: str  # block type, e.g. "Q8_0"
    shape: tuple[int, ...]  # PyTorch order
    data: np.ndarray  # the blocks as gguf maps them (memory-mapped)


def split_parts(path: str) -> list[str]:
    """The files of the GGUF at `path`: itself, or every part of its split set in order.

    Raises:
        FileNotFoundError: a part of the split set is missing (named).
    """
    m = _SPLIT.match(os.path.basename(path))
    if m is None:
        return [path]
    count = int(m["count"])
    folder = os.path.dirname(path)
    parts = [
        os.path.join(folder, f"{m['stem']}-{i:05d}-of-{count:05d}.gguf")
        for i in range(1, 1 + count)
    ]
    missing = [os.path.basename(p) for p in parts if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(
            f"split GGUF {os.path.basename(path)}: missing {', '.join(missing)}"
        )
    return parts


def find_gguf_files(path: str) -> list[str]:
    """The model's GGUF files: `path` itself (with its split parts) when it is a `.gguf` file,
    else the one GGUF (or the one split set) in directory `path` (image projectors,
    `mmproj*.gguf`, left aside); [] when there is none.

    Raises:
        ValueError: the directory holds several models' GGUF files (named).
    """
    if os.path.isfile(path):
        return split_parts(path) if path.endswith(".gguf") else []
    if not os.path.isdir(path):
        return []
    files = sorted(
        f
        for f in glob.glob(os.path.join(glob.escape(path), "*.gguf"))
        if not os.path.basename(f).startswith(_PROJECTOR_PREFIX)
    )
    models = sorted({_SPLIT.sub(r"\g<stem>", os.path.basename(f)) for f in files})
    if len(models) > 1:
        raise ValueError(
            f"model directory {path!r} holds several GGUF models ({', '.join(models)}); name the "
            "file (model='dir/file.gguf') or keep one per directory"
        )
    return split_parts(files[0]) if files else []


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_FLOAT_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8", "I8": "<i1",
                 "I16": "<i2", "I32": "<i4", "I64": "<i8"}  # fmt: skip


class _Cursor:
    """Reads GGUF header values from a buffer, little-endian."""

    def __init__(self, buf: Any, file: str) -> None:
        self.buf, self.pos, self.file = buf, 0, file

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype in _NUMPY:
                dt = np.dtype(_NUMPY[itype])
                out = np.frombuffer(self.buf, dt, count, self.pos).tolist()
                self.pos += dt.itemsize * count
                return out
            return [self.value(itype) for _ in range(count)]
        if vtype not in _SCALAR:
            raise ValueError(f"{self.file}: unknown GGUF value type {vtype} at byte {self.pos}")
        return self.scalar(_SCALAR[vtype])


def read_gguf(file: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """The metadata and tensors of one GGUF file (see the module docstring).

    Raises:
        ValueError: not a GGUF file of version 2 or 3, or a tensor of an unknown type.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    mm = np.memmap(file, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm), file)
    if bytes(mm[:4]) != b"GGUF":
        raise ValueError(f"{file}: not a GGUF file (magic {bytes(mm[:4])!r})")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3) and (version >> 24) in (2, 3):
        raise ValueError(f"{file}: a big-endian GGUF file; only little-endian files are read")
    if version not in (2, 3):
        raise ValueError(f"{file}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        type_id, offset = cur.scalar("<I"), cur.scalar("<Q")
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError as err:
            raise ValueError(f"{file}: tensor {name} has unknown block type {type_id}") from err
        infos.append((name, dims, qtype, offset))
    align = int(metadata.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, qtype, offset in infos:
        shape = tuple(int(d) for d in reversed(dims))  # PyTorch order
        block, nbytes = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(shape)) if shape else 1
        size = count // block * nbytes
        raw = mm[start + offset : start + offset + size]
        if qtype.name in _FLOAT_DTYPES:
            data = raw.view(_FLOAT_DTYPES[qtype.name]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], shape[-1] // block * nbytes)
        tensors.append(GGUFTensor(name, qtype.name, shape, data))
    return metadata, tensors


class GGUFFile:
    """The metadata and tensors of a GGUF model (one file or a split set, see the module
    docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.files = split_parts(path)
        self.metadata: dict[str, Any] = {}
        self.tensors: list[GGUFTensor] = []
        for file in self.files:
            metadata, tensors = read_gguf(file)
            for key, value in metadata.items():
                if key not in _SPLIT_KEYS:
                    self.metadata.setdefault(key, value)
            self.tensors.extend(tensors)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name -> shape (PyTorch order)."""
        return {t.name: t.shape for t in self.tensors}

    @property
    def architecture(self) -> str:
        """`general.architecture`.

        Raises:
            ValueError: the file does not say.
        """
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{self.path}: no general.architecture in the GGUF metadata")
        return arch
