"""The plain-read safetensors reader against the `safetensors` library, and its errors."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.helpers.tmp_dirs import make_tmp_dir
from vllm_mamba.models.safetensors_reader import read_safetensors


def test_reads_every_dtype_as_safetensors_does() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(3, 64, generator=g).bfloat16(),
        "f16": torch.randn(9, generator=g).half(),
        "i8": torch.randint(-128, 127, (4, 4), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (6,), dtype=torch.uint8, generator=g),
        "i64": torch.arange(5),
        "bool": torch.tensor([True, False, True]),
        "f8": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    file = os.path.join(make_tmp_dir("st-reader-"), "m.safetensors")
    save_file(tensors, file, metadata={"format": "pt"})
    got = list(read_safetensors(file))
    with safe_open(file, framework="pt") as f:
        assert [n for n, _ in got] == list(f.keys())
        for name, tensor in got:
            want = f.get_tensor(name)
            assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
            raw = (t.reshape(-1).view(torch.uint8) for t in (tensor, want))
            assert torch.equal(*raw), name


def _write(file: str, header: object, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}, b"\0", "dtype 'Q4'"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "4 bytes"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "past the end"),
        ({"w": {"shape": [2]}}, b"", "malformed"),
        ([1, 2], b"", "not a JSON object"),
    ],
)
def test_malformed_files_are_named(header: object, data: bytes, message: str) -> None:
    file = os.path.join(make_tmp_dir("st-bad-"), "bad.safetensors")
    _write(file, header, data)
    with pytest.raises(ValueError, match=message) as err:
        list(read_safetensors(file))
    assert "bad.safetensors" in str(err.value)
