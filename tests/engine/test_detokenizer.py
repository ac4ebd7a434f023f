"""Incremental detokenization (`DecodeStream` for fast tokenizers, the window method
otherwise) gives exactly the text of a whole decode, token by token."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from tests.tiny_models import TOKENIZER_DIR
from vllm_mamba.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "héllo wörld — 日本語テキスト 🎉🎉 ok",
    "def f(x):\n    return x ** 2  # ünïcödé",
    "    spaces   and\ttabs\n\n",
    "<|endoftext|>after the end",
]


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201 - a transformers tokenizer
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def _incremental(tokenizer, prompt: list[int], ids: list[int], skip: bool, stream: bool) -> str:  # noqa: ANN001
    detok = IncrementalDetokenizer(tokenizer, prompt, skip)
    if not stream:
        detok._stream = None
    return "".join(detok.add(t) for t in ids)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("skip", [True, False])
def test_texts_round_trip(tokenizer, stream: bool, skip: bool) -> None:  # noqa: ANN001
    for text in TEXTS:
        ids = tokenizer.encode(text)
        want = tokenizer.decode(ids, skip_special_tokens=skip)
        assert _incremental(tokenizer, [5, 6], ids, skip, stream) == want


@pytest.mark.parametrize("stream", [True, False])
def test_random_tokens_equal_a_whole_decode(tokenizer, stream: bool) -> None:  # noqa: ANN001
    rng = random.Random(0)
    used_stream = 0
    for _ in range(400):
        ids = [rng.randrange(50277) for _ in range(rng.randint(1, 30))]
        prompt = [rng.randrange(50277) for _ in range(rng.randint(1, 8))]
        want = tokenizer.decode(ids, skip_special_tokens=True)
        if want.endswith("\ufffd"):
            continue  # an unfinished character is held back until it completes
        used_stream += IncrementalDetokenizer(tokenizer, prompt, True)._stream is not None
        assert _incremental(tokenizer, prompt, ids, True, stream) == want, (prompt, ids)
    assert used_stream > 300  # the fast path is the one normally taken
