"""A SentencePiece vocabulary through GGUF: a tiny Mamba2 checkpoint shipping a real
`tokenizer.model` (trained here by `sentencepiece`: BPE with byte fallback, split digits and
no whitespace normalisation, as Llama's and Mistral's), written as GGUF by llama.cpp's
converter (Mamba2 reads `tokenizer.model` first: `_set_vocab_sentencepiece`,
`tokenizer.ggml.model` "llama", the vocabulary padded to a multiple of 16 with `[PADn]`), and
the tokenizer the engine builds from that file (`load_tokenizer` on the `.gguf`) checked
against two references:

- `sentencepiece` itself on the `tokenizer.model`: the same ids for every text of a corpus
  (spaces, newlines, tabs, code, digits, CJK and emoji through byte fallback), BOS before
  them when special tokens are added, the same decoding; special-token text inside a prompt
  splits as llama.cpp splits it (each piece of text between special tokens encoded as a text
  of its own).
- the Hugging Face tokenizer of the checkpoint (`AutoTokenizer`, as the engine loads a
  safetensors checkpoint): the same ids with and without special tokens, the same decoding
  and the same BOS/EOS/UNK/PAD ids; except where transformers' `Metaspace` leaves out
  SentencePiece's dummy prefix (a text that starts with a space), where the test pins that
  the Hugging Face ids are the ones that differ from `sentencepiece`'s.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil

import pytest
import torch

from tests.gguf.conftest import convert
from tests.helpers.tmp_dirs import make_tmp_dir

SP_VOCAB = 376  # the converter pads the GGUF's to the model's 384 (a multiple of 16)
CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "trailing spaces   ",
    "inner  double   triple    spaces",
    "line one\nline two\n\nline four\n",
    "tab\tseparated\tvalues\t\n",
    "naïve café Ünïcödé e\u0301 Ω≈ç√",
    "日本語のテキスト 中文 한국어",
    "emoji 🤖🚀 and ZWJ 👩\u200d💻",
    "12345 3.14159 1,000,000 0x1F -42e-3",
    "def f(x):\n    return x**2  # comment\n\tif a != b: pass\n",
    "{'key': [1, 2, 3]} <tag attr=\"v\"/> && || ~",
    "▁literal meta space",
    "[PAD380] <0x41> not special",
    "x",
    "\n",
    "",
    # texts that start with a space (where transformers differs from sentencepiece; also
    # "▁literal meta space" above)
    " hi",
    "  two leading",
    "   ",
    "\u3000ideographic space",  # not ASCII space: no difference
]
WORDS = (
    "the of and to in is was that for on with as by at from this be it are or an which have "
    "one not but all were when we there can more if will about up out into time so some what "
    "other them new their these may def return import class self print value list"
).split()


def _train(path: str) -> None:
    """Trains a SentencePiece BPE model of `SP_VOCAB` pieces into `path` (Llama's options:
    byte fallback, digits split, whitespace kept as written, `<unk>` `<s>` `</s>` at 0-2)."""
    import sentencepiece as spm

    rng = random.Random(0)
    lines = [
        " ".join(rng.choice(WORDS) for _ in range(10)) + f" {i}\n    x_{i} = f({i * 7})\treturn"
        for i in range(300)
    ]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=SP_VOCAB,
        model_type="bpe", byte_fallback=True, split_digits=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2,
    )  # fmt: skip
    with open(path, "wb") as f:
        f.write(model.getvalue())


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    """`sp` (sentencepiece on the checkpoint's `tokenizer.model`), `hf` (the checkpoint's
    Hugging Face tokenizer) and `gguf` (the engine's tokenizer of the converted file)."""
    import sentencepiece as spm
    from transformers import AutoTokenizer, Mamba2Config, Mamba2ForCausalLM

    from vllm_mamba.tokenizer import load_tokenizer

    # A SentencePiece checkpoint as released: tokenizer.model and tokenizer_config.json, the
    # tokenizer.json transformers converts from them saved beside.
    spm_dir, hf_dir = make_tmp_dir("spm-"), make_tmp_dir("gguf-spm-mamba2-")
    _train(os.path.join(spm_dir, "tokenizer.model"))
    config = {
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>",
        "legacy": False,
    }  # fmt: skip
    with open(os.path.join(spm_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    AutoTokenizer.from_pretrained(spm_dir).save_pretrained(hf_dir)
    shutil.copy(os.path.join(spm_dir, "tokenizer.model"), hf_dir)
    torch.manual_seed(0)
    model_config = Mamba2Config(
        hidden_size=64, num_hidden_layers=1, expand=2, num_heads=4, head_dim=32, n_groups=1,
        state_size=16, conv_kernel=4, chunk_size=16, vocab_size=384,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    Mamba2ForCausalLM(model_config).save_pretrained(hf_dir)
    gguf_file = os.path.join(make_tmp_dir("gguf-spm-"), "mamba2-spm-f32.gguf")
    convert((hf_dir, "f32", gguf_file))
    return {
        "sp": spm.SentencePieceProcessor(model_file=os.path.join(hf_dir, "tokenizer.model")),
        "hf": AutoTokenizer.from_pretrained(hf_dir),
        "gguf": load_tokenizer(gguf_file),
        "gguf_file": gguf_file,
    }


def test_the_converter_wrote_a_sentencepiece_vocabulary(tokenizers: dict) -> None:
    from vllm_mamba.gguf.reader import GGUFFile

    meta, sp = GGUFFile(tokenizers["gguf_file"]).metadata, tokenizers["sp"]
    assert meta["tokenizer.ggml.model"] == "llama"
    tokens = meta["tokenizer.ggml.tokens"]
    assert tokens[:SP_VOCAB] == [sp.id_to_piece(i) for i in range(SP_VOCAB)]
    assert tokens[SP_VOCAB:] == [f"[PAD{i}]" for i in range(SP_VOCAB, 384)]
    assert meta["tokenizer.ggml.add_bos_token"] is True


def test_ids_equal_sentencepiece(tokenizers: dict) -> None:
    sp, ours = tokenizers["sp"], tokenizers["gguf"]
    for text in CORPUS:
        want = sp.encode(text)
        assert ours.encode(text, add_special_tokens=False) == want, text
        assert ours.encode(text) == [sp.bos_id(), *want], text
        written = text.replace("▁", " ")  # the meta space reads back as a space
        assert ours.decode(want) == sp.decode(want) == written, text
        assert ours.decode([sp.bos_id(), *want], skip_special_tokens=True) == written, text
    assert any(sp.id_to_piece(i).startswith("<0x") for i in sp.encode(CORPUS[7]))  # fallback


def test_special_token_text_splits_as_llama_cpp(tokenizers: dict) -> None:
    """llama.cpp (parse_special) cuts a prompt at the special tokens' text and encodes each
    piece between as a text of its own, the dummy prefix included."""
    sp, ours, hf = tokenizers["sp"], tokenizers["gguf"], tokenizers["hf"]
    bos, eos = sp.bos_id(), sp.eos_id()
    cases = {
        "<s>text</s>": [bos, *sp.encode("text"), eos],
        "a</s>b c": [*sp.encode("a"), eos, *sp.encode("b c")],
        "<s> spaced </s> ": [bos, *sp.encode(" spaced "), eos, *sp.encode(" ")],
    }
    for text, want in cases.items():
        assert ours.encode(text, add_special_tokens=False) == want, text
        specials = [i for i in want if i in (bos, eos)]
        assert [i for i in hf.encode(text, add_special_tokens=False) if i in (bos, eos)] == specials


def test_ids_equal_the_hugging_face_tokenizer(tokenizers: dict) -> None:
    sp, hf, ours = tokenizers["sp"], tokenizers["hf"], tokenizers["gguf"]
    differ = []
    for text in CORPUS:
        for special in (False, True):
            got = ours.encode(text, add_special_tokens=special)
            want = hf.encode(text, add_special_tokens=special)
            if got != want:
                # transformers' Metaspace puts no `▁` before a text that starts with one (or
                # a space): its ids are those of the text less that one, not sentencepiece's.
                assert got == [*([sp.bos_id()] if special else []), *sp.encode(text)], text
                assert want == ours.encode(text[1:], add_special_tokens=special), text
                differ.append(text)
            assert ours.decode(got) == hf.decode(got), text
            assert ours.decode(got, skip_special_tokens=True) == hf.decode(
                got, skip_special_tokens=True
            ), text
    assert sorted(set(differ)) == sorted(t for t in CORPUS if t[:1] in (" ", "▁"))
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(ours, f"{name}_token_id") == getattr(hf, f"{name}_token_id"), name
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id, ours.pad_token_id) == (
        sp.bos_id(), sp.eos_id(), sp.unk_id(), 0
    )  # fmt: skip
