"""N-gram prompt lookup: vLLM's choice (longest n-gram, earliest occurrence), truncation,
linear time, validation."""

from __future__ import annotations

import random

import pytest

from vllm_mamba.spec_decode.ngram import NgramProposer, find_ngram


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix n-gram with an earlier occurrence followed by at least one token;
    the earliest such occurrence."""
    total = len(tokens)
    for n in range(min(max_n, total), min_n - 1, -1):
        suffix = tokens[total - n :]
        for i in range(total - n):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_hand_made_lists() -> None:
    p = NgramProposer(k=4, min_n=2, max_n=3)
    # vLLM's docstring example: [4, 2, 3] has no match, [2, 3] matches at 1, 3 tokens follow.
    assert p.propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]
    assert p.propose([5, 6, 7, 8, 9, 5, 6]) == [7, 8, 9, 5]
    assert p.propose([1, 2, 3, 4]) == []  # nothing recurs
    assert p.propose([1]) == []  # shorter than prompt_lookup_min
    assert p.propose([]) == []
    # a single-token repeat is below prompt_lookup_min=2
    assert p.propose([7, 1, 2, 7]) == []
    assert NgramProposer(k=2, min_n=1, max_n=3).propose([7, 1, 2, 7]) == [1, 2]


def test_longest_ngram_wins_over_a_shorter_earlier_one() -> None:
    p = NgramProposer(k=2, min_n=1, max_n=3)
    # [3] occurs first at 1 (followed by 10), but [2, 3] occurs at 4 (followed by 20).
    toks = [9, 3, 10, 11, 2, 3, 20, 21, 2, 3]
    assert p.propose(toks) == [20, 21]
    # with max_n=1 only the 1-gram counts: the earliest [3] wins
    assert NgramProposer(k=2, min_n=1, max_n=1).propose(toks) == [10, 11]
    # the n-gram is capped at max_n: [1, 2, 3] recurs, but only [2, 3] (n=2) is looked up, and
    # its earliest occurrence is taken
    toks = [2, 3, 7, 1, 2, 3, 8, 1, 2, 3]
    assert NgramProposer(k=1, min_n=1, max_n=2).propose(toks) == [7]
    assert NgramProposer(k=1, min_n=1, max_n=3).propose(toks) == [8]


def test_earliest_occurrence_as_vllm() -> None:
    p = NgramProposer(k=3, min_n=2, max_n=2)
    assert p.propose([1, 2, 5, 5, 1, 2, 6, 6, 1, 2]) == [5, 5, 1]
    # an occurrence may overlap the suffix itself (periodic runs)
    assert p.propose([4, 4, 4, 4, 4]) == [4, 4, 4]


def test_k_truncated_at_the_end_and_by_max_model_len() -> None:
    p = NgramProposer(k=5, min_n=1, max_n=2)
    assert p.propose([1, 2, 1]) == [2, 1]  # only two tokens follow the match
    assert NgramProposer(k=5, min_n=1, max_n=2, max_model_len=5).propose([1, 2, 3, 1]) == [2]
    assert NgramProposer(k=5, min_n=1, max_n=2, max_model_len=4).propose([1, 2, 3, 1]) == []


def test_matches_brute_force_on_random_lists() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        total = rng.randint(0, 30)
        toks = [rng.randint(0, 3) for _ in range(total)]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 5)
        got = NgramProposer(k=k, min_n=min_n, max_n=max_n).propose(toks)
        assert got == brute_force(toks, k, min_n, max_n), (toks, k, min_n, max_n)


def test_long_list_is_linear() -> None:
    """200k tokens, with a long periodic run (quadratic for naive scans) and a worst case for
    the failure table."""
    rng = random.Random(1)
    toks = [rng.randint(0, 50_000) for _ in range(100_000)] + [7] * 100_000
    assert NgramProposer(k=4, min_n=1, max_n=64).propose(toks) == [7, 7, 7, 7]
    toks = [0] * 199_999 + [1]
    assert NgramProposer(k=4, min_n=1, max_n=1024).propose(toks) == []
    assert find_ngram([1] * 200_000, 1, 1024) == (1024, 1024)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"k": 0, "min_n": 1, "max_n": 2}, "num_speculative_tokens"),
        ({"k": 2, "min_n": 0, "max_n": 2}, "prompt_lookup_min"),
        ({"k": 2, "min_n": 3, "max_n": 2}, "prompt_lookup_max"),
        ({"k": 2, "min_n": 1.5, "max_n": 2}, "prompt_lookup_min"),
        ({"k": True, "min_n": 1, "max_n": 2}, "num_speculative_tokens"),
    ],
)
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        NgramProposer(**kwargs)
