"""`bad_words` tokenization is linear in the number of words (it was quadratic: 10,000 words
took 10.7 s on the engine thread), and the limits on list-valued fields are ValueErrors."""

from __future__ import annotations

import time

import pytest

from vllm_mamba import SamplingParams
from vllm_mamba import request_limits as limits

pytestmark = pytest.mark.whole_machine  # a ratio of two timings


class CountingTokenizer:
    """Each word is its own token sequence."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def _tokenize(count: int) -> float:
    params = SamplingParams()
    params.bad_words = [f"word{i}" for i in range(count)]  # past the limit, on purpose
    start = time.perf_counter()
    params.update_from_tokenizer(CountingTokenizer())
    elapsed = time.perf_counter() - start
    assert len(params.bad_words_token_ids) == 2 * count
    return elapsed


def test_bad_words_tokenization_is_linear() -> None:
    small = min(_tokenize(1_000) for _ in range(3))
    large = min(_tokenize(10_000) for _ in range(3))
    assert large < 30 * small, (small, large)  # quadratic would be ~100x


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop", ["s"] * (limits.MAX_STOP + 1)),
        ("bad_words", ["w"] * (limits.MAX_BAD_WORDS + 1)),
        ("logit_bias", {i: 1.0 for i in range(limits.MAX_LOGIT_BIAS_ENTRIES + 1)}),
    ],
)
def test_lists_over_their_limit_are_value_errors(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field} has"):
        SamplingParams(**{field: value})
