"""Reads a safetensors file tensor by tensor with plain file reads, not a memory map.

`safetensors.safe_open(...).get_tensor` copies each tensor out of a memory map of the whole
file; the pages it touched stay mapped into the process until the file is closed, so loading
a 3 GB checkpoint counted 3 GB of file pages in the process's resident memory on top of the
model (Qwen3.5-0.8B float32 loaded for int4 peaked at 6.2 GiB for 0.5 GiB of weights). Here
each tensor is read with `readinto` straight into its own freshly allocated storage: the
resident memory of loading is the tensors the caller still holds, nothing else.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length
N, N bytes of JSON mapping each name to `{"dtype", "shape", "data_offsets": [begin, end]}`
(offsets relative to the end of the header; an optional `__metadata__` entry), then the data,
little-endian, row-major (so `formats` reads with this on little-endian hosts only).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from typing import Any

import torch

# The safetensors dtype names this reader maps to torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32,
    "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit


def read_header(f: Any, file: str) -> tuple[dict[str, dict[str, Any]], int]:
    """The tensor entries of the open file `f` (name -> entry, `__metadata__` left out) and
    the byte offset where the data starts.

    Raises:
        ValueError: a header that is not one of a safetensors file, naming `file`.
    """
    head = f.read(8)
    if len(head) != 8:
        raise ValueError(f"{file}: not a safetensors file (shorter than its header length)")
    (size,) = struct.unpack("<Q", head)
    if size > MAX_HEADER_BYTES:
        raise ValueError(f"{file}: safetensors header of {size} bytes is too large")
    try:
        header = json.loads(f.read(size))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file}: the safetensors header is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise ValueError(f"{file}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + size


def _tensor_of(name: str, entry: Any, file: str) -> tuple[torch.Tensor, int, int]:
    """An empty tensor for one header entry and its data range `[begin, end)`.

    Raises:
        ValueError: an unknown dtype, or a range that does not hold the shape's bytes.
    """
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise ValueError(f"{file}: tensor {name!r} has a malformed header entry")
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"{file}: tensor {name!r} has dtype {entry['dtype']!r}, not one of "
                         f"{sorted(DTYPES)}")  # fmt: skip
    begin, end = (int(o) for o in entry["data_offsets"])
    tensor = torch.empty([int(d) for d in entry["shape"]], dtype=dtype)
    if end - begin != tensor.numel() * tensor.element_size() or begin < 0:
        raise ValueError(
            f"{file}: tensor {name!r} of shape {entry['shape']} and dtype {entry['dtype']} "
            f"has {end - begin} bytes of data"
        )
    return tensor, begin, end


def _read_into(f: Any, tensor: torch.Tensor, file: str, name: str) -> None:
    """Fills `tensor`'s storage from the file's current position."""
    if tensor.numel() == 0:
        return
    view = memoryview(tensor.view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise ValueError(f"{file}: tensor {name!r} is cut short (the file ends)")
        done += got


def read_safetensors(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields `(name, tensor)` for every tensor of the safetensors `file`, in name order (as
    `safe_open(...).keys()` lists them), each read into its own storage.

    Raises:
        ValueError: a malformed file, naming it and the tensor.
    """
    total = os.path.getsize(file)
    with open(file, "rb", buffering=0) as f:
        header, data_start = read_header(f, file)
        for name in sorted(header):
            tensor, begin, end = _tensor_of(name, header[name], file)
            if data_start + end > total:
                raise ValueError(f"{file}: tensor {name!r} lies past the end of the file")
            f.seek(data_start + begin)
            _read_into(f, tensor, file, name)
            yield name, tensor
