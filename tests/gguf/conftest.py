"""GGUF test helpers: llama.cpp's converter (fetched by `make install-dev` into
`.cache/llama-cpp-convert/`), tiny Hugging Face models written as GGUF with it, GGUF files
rewritten with other block types through gguf-py's writer and quantiser, and the float
reference checkpoint of a quantised GGUF (each weight replaced by gguf-py's dequantisation of
its blocks, named back through gguf-py's own tensor-name table).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONVERTER = os.path.join(ROOT, ".cache", "llama-cpp-convert", "convert_hf_to_gguf.py")


def converter() -> str:
    """The path of llama.cpp's `convert_hf_to_gguf.py`; fails the test when it is missing."""
    if not os.path.isfile(CONVERTER):
        pytest.fail(
            f"llama.cpp's GGUF converter is missing ({CONVERTER}): run `make install-dev` (it "
            "fetches it from the llama-cpp-python source package)"
        )
    return CONVERTER


_MANY = """
import os, runpy, sys
converter, jobs = sys.argv[1], sys.argv[2:]
sys.path.insert(0, os.path.dirname(converter))
main = runpy.run_path(converter, run_name="llama_cpp_convert")["main"]
for i in range(0, len(jobs), 3):
    sys.argv = [converter, jobs[i], "--outtype", jobs[i + 1], "--outfile", jobs[i + 2]]
    main()
"""


def convert(*jobs: tuple[str, str, str]) -> None:
    """Each `(hf_dir, outtype, out_file)` written as GGUF by llama.cpp's converter (one
    process for all: its imports take seconds)."""
    args = [part for job in jobs for part in job]
    proc = subprocess.run(
        [sys.executable, "-c", _MANY, converter(), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for _, _, out_file in jobs:
        assert os.path.isfile(out_file), out_file


def _value_type(value: Any) -> Any:
    from gguf import GGUFValueType

    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.INT32 if -(2**31) <= value < 2**31 else GGUFValueType.UINT64
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    raise TypeError(value)


K_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per block of 256
_K_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # float16 fields of a block


def random_k_blocks(type_name: str, rows: int, cols: int, seed: int, scale: float) -> np.ndarray:
    """`(rows, bytes per row)` random blocks of K-quant `type_name` (which gguf-py cannot
    write) for a `(rows, cols)` weight: random bytes, the float16 scales N(0, scale^2)."""
    rng = np.random.default_rng(seed)
    nb, nbytes = cols // 256, K_BYTES[type_name]
    raw = rng.integers(0, 256, (rows, nb, nbytes), dtype=np.uint8)
    for at in _K_HALVES[type_name]:
        halves = (rng.standard_normal((rows, nb)) * scale).astype(np.float16)
        raw[..., at : at + 2] = halves.view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * nbytes)


def rewrite(
    src: str,
    dst: str,
    quantize: dict[str, str],
    split_max_tensors: int = 0,
    raw: dict[str, tuple[str, np.ndarray]] | None = None,
) -> str:
    """GGUF `src` written again as `dst` by gguf-py's writer, the tensors named in `quantize`
    (GGUF name -> type) quantised from their float values by gguf-py's quantiser, those in
    `raw` replaced by the given `(type, blocks)`; with `split_max_tensors`, as a split set
    (`dst` minus `.gguf` plus `-0000i-of-0000n.gguf`)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    from vllm_mamba.gguf.reader import GGUFFile

    source = GGUFFile(src)
    arch = source.metadata["general.architecture"]
    writer = GGUFWriter(dst, arch, split_max_tensors=split_max_tensors)
    for key, value in source.metadata.items():
        if key == "general.architecture":
            continue
        if isinstance(value, list):
            from gguf import GGUFValueType

            writer.add_key_value(key, value, GGUFValueType.ARRAY, _value_type(value[0]))
        else:
            writer.add_key_value(key, value, _value_type(value))
    for t in source.tensors:
        qtype = GGMLQuantizationType[t.type_name]
        data = np.asarray(t.data)
        if raw and t.name in raw:
            kind, blocks = raw[t.name]
            writer.add_tensor(t.name, blocks, raw_dtype=GGMLQuantizationType[kind])
        elif t.name in quantize:
            values = dequantize(data, qtype).reshape(t.shape)
            new = GGMLQuantizationType[quantize[t.name]]
            writer.add_tensor(t.name, gguf_quantize(values, new), raw_dtype=new)
        elif t.type_name in ("F32", "F16"):
            writer.add_tensor(t.name, data.reshape(t.shape))
        else:
            writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def dequantized_checkpoint(hf_dir: str, gguf_file: str, arch: str, out_dir: str) -> str:
    """`hf_dir` saved again into `out_dir` with each weight the GGUF file stores quantised or
    as float16 replaced by gguf-py's dequantisation of it (the name mapped by gguf-py's
    `TensorNameMap`); float32 tensors keep the checkpoint's values."""
    import gguf
    from gguf.quants import dequantize
    from safetensors.torch import load_file, save_file

    from vllm_mamba.gguf.reader import GGUFFile

    config = json.load(open(os.path.join(hf_dir, "config.json")))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    tensors = {t.name: t for t in GGUFFile(gguf_file).tensors}
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    replaced = 0
    for hf_name, value in state.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        t = tensors.get(name) if name is not None else None
        if t is None and hf_name == "lm_head.weight":
            t = tensors.get("output.weight")
        if t is None or t.type_name == "F32":
            continue
        values = dequantize(np.asarray(t.data), gguf.GGMLQuantizationType[t.type_name])
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(values, np.float32)).reshape(
            value.shape
        )
        replaced += 1
    assert replaced > 0
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(hf_dir):
        if f != "model.safetensors":
            shutil.copy(os.path.join(hf_dir, f), out_dir)
    save_file(
        {k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors")
    )
    return out_dir
