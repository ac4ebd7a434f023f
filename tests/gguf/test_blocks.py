"""GGUF blocks decoded into the engine's layouts, against gguf-py's reference dequantisers.

Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks come from gguf-py's quantiser on random weights; the
K-quants (which gguf-py cannot write) are random bytes with finite float16 scales. Every
layout must dequantise to exactly `gguf.quants.dequantize` of the same bytes. The header
reader is checked against gguf-py's `GGUFReader` on a file of every value type.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from tests.gguf.conftest import K_BYTES, random_k_blocks
from vllm_mamba.gguf.blocks import decode_tensor
from vllm_mamba.gguf.reader import GGUFFile
from vllm_mamba.layers.packed_weights import packed_of

T = GGMLQuantizationType
LAYOUTS = {  # type -> (bits, group, has offsets)
    "Q4_0": (4, 32, True), "Q4_1": (4, 32, True), "Q5_0": (8, 32, False),
    "Q5_1": (8, 32, True), "Q8_0": (8, 32, False), "Q4_K": (4, 32, True),
    "Q5_K": (8, 32, True), "Q6_K": (8, 16, False),
}  # fmt: skip


def _blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """`(rows, bytes per row)` uint8 blocks of `type_name` for a `(rows, cols)` weight."""
    if type_name in K_BYTES:
        return random_k_blocks(type_name, rows, cols, seed, scale=0.05)
    rng = np.random.default_rng(seed)
    return quantize(rng.standard_normal((rows, cols)).astype(np.float32), T[type_name])


@pytest.mark.parametrize("type_name", sorted(LAYOUTS))
def test_layout_dequantises_exactly_to_gguf_reference(type_name: str) -> None:
    rows, cols = 5, 512
    data = _blocks(type_name, rows, cols, seed=len(type_name) + ord(type_name[1]))
    want = torch.from_numpy(dequantize(data, T[type_name]).astype(np.float32)).reshape(rows, cols)
    tensor = decode_tensor("blk.0.w.weight", type_name, (rows, cols), data)
    layout = packed_of(tensor)
    bits, group, has_offsets = LAYOUTS[type_name]
    assert (layout.bits, layout.group, layout.offsets is not None) == (bits, group, has_offsets)
    assert layout.codes.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert torch.equal(layout.dequantize(), want)
    assert torch.equal(tensor, want)


def test_q4_0_is_the_engine_int4_layout() -> None:
    """Q4_0's layout is the int4 kernel's: float16 scales, offsets -8 times them, and the
    packed bytes as they are in the file (weight j low nibble, j + 16 high)."""
    data = _blocks("Q4_0", 3, 64, seed=1)
    layout = packed_of(decode_tensor("w", "Q4_0", (3, 64), data))
    assert torch.equal(layout.scales.half().float(), layout.scales)
    assert torch.equal(layout.offsets, -8 * layout.scales)
    qs = data.reshape(3, 2, 18)[..., 2:].reshape(3, 32)
    assert torch.equal(layout.codes, torch.from_numpy(qs))


def test_float_and_one_dimensional_tensors_are_float() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    assert torch.equal(decode_tensor("a", "F32", (4, 32), x), torch.from_numpy(x))
    h = x.astype(np.float16)
    assert torch.equal(decode_tensor("a", "F16", (4, 32), h), torch.from_numpy(h))
    bf = torch.from_numpy(x).bfloat16()
    got = decode_tensor("a", "BF16", (4, 32), bf.view(torch.int16).numpy().view(np.uint16))
    assert torch.equal(got, bf)
    q = quantize(x.reshape(-1), T.Q8_0)
    one_d = decode_tensor("norm.weight", "Q8_0", (128,), q)
    assert packed_of(one_d) is None
    assert torch.equal(one_d, torch.from_numpy(dequantize(q, T.Q8_0)))


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "IQ4_XS", "TQ1_0", "MXFP4"])
def test_other_block_types_are_one_clear_error(type_name: str) -> None:
    with pytest.raises(ValueError, match=rf"blk\.3\.ssm_in\.weight: block type {type_name}"):
        decode_tensor("blk.3.ssm_in.weight", type_name, (4, 256), np.zeros((4, 8), np.uint8))


def test_reader_matches_gguf_reader(tmp_path) -> None:  # noqa: ANN001 - pytest's tmp_path
    """Every metadata value and tensor (PyTorch order, raw blocks) as gguf-py reads them."""
    from gguf import GGUFReader

    path = str(tmp_path / "all.gguf")
    w = GGUFWriter(path, "mamba2")
    w.add_uint32("a.u32", 7)
    w.add_int64("a.i64", -(2**40))
    w.add_float32("a.f32", 1e-5)
    w.add_float64("a.f64", 0.1)
    w.add_bool("a.bool", True)
    w.add_string("a.str", "héllo")
    w.add_array("a.strs", ["x", "", "日本"])
    w.add_array("a.ints", [1, -2, 3])
    w.add_array("a.floats", [0.5, 1.5])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 3, 32)).astype(np.float16))
    w.add_tensor("q8", quantize(rng.standard_normal((4, 64)).astype(np.float32), T.Q8_0),
                 raw_dtype=T.Q8_0)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, ref = GGUFFile(path), GGUFReader(path)
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.type_name == b.tensor_type.name
        assert a.shape == tuple(reversed(b.shape.tolist()))
        assert np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8))


def test_model_files_of_a_directory(tmp_path) -> None:  # noqa: ANN001 - pytest's tmp_path
    """One model (or one split set) per directory; image projectors left aside."""
    from vllm_mamba.gguf.reader import find_gguf_files

    for name in ("m-00001-of-00002.gguf", "m-00002-of-00002.gguf", "mmproj-m-f16.gguf"):
        (tmp_path / name).write_bytes(b"")
    parts = [str(tmp_path / f"m-0000{i}-of-00002.gguf") for i in (1, 2)]
    assert find_gguf_files(str(tmp_path)) == parts
    assert find_gguf_files(parts[1]) == parts
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(FileNotFoundError, match="missing m-00002-of-00002.gguf"):
        find_gguf_files(str(tmp_path))
    (tmp_path / "other.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF models"):
        find_gguf_files(str(tmp_path))


def test_sentencepiece_vocabulary_splits_as_sentencepiece() -> None:
    """A `llama` vocabulary (scores best first, byte tokens): the pieces SentencePiece's BPE
    gives on this toy vocabulary, worked out by hand (spaces to `▁`, one `▁` put before the
    text, highest-scored merge first, unknown characters as their UTF-8 bytes)."""
    from vllm_mamba.gguf.tokenizer import gguf_tokenizer

    pieces = ["▁", "a", "b", "h", "i", "▁a", "ab", "▁ab", "hi", "▁hi"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), *pieces]
    meta = {
        "general.architecture": "mamba2", "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True,
    }  # fmt: skip
    tok = gguf_tokenizer(meta)
    cases = {
        "hi ab": ["<s>", "▁hi", "▁ab"],
        " hi": ["<s>", "▁", "▁hi"],
        "a€b": ["<s>", "▁a", "<0xE2>", "<0x82>", "<0xAC>", "b"],
        "hi\nab": ["<s>", "▁hi", "<0x0A>", "ab"],
    }
    for text, want in cases.items():
        ids = tok.encode(text)
        assert tok.convert_ids_to_tokens(ids) == want, text
        assert tok.decode(ids, skip_special_tokens=True) == text, text
