"""Stop strings, stop tokens, min_tokens and the text they leave, against a plain greedy run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import CompletionOutput, SamplingParams

PROMPT = "The history of the"


@pytest.fixture(scope="module")
def llm(vllm_runner: type[VllmRunner]) -> Iterator[VllmRunner]:
    with vllm_runner(tiny_model_dir("tied")) as runner:
        yield runner


@pytest.fixture(scope="module")
def reference(llm: VllmRunner) -> tuple[list[int], str]:
    """24 greedy tokens and their text, with no stop condition."""
    out = run(llm)
    return out.token_ids, out.text


def run(llm: VllmRunner, **kwargs) -> CompletionOutput:  # noqa: ANN003
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kwargs)
    return llm.generate(PROMPT, params)[0].outputs[0]


def test_text_is_the_decoded_tokens(llm: VllmRunner, reference: tuple[list[int], str]) -> None:
    tokens, text = reference
    assert len(tokens) == 24 and len(set(tokens)) > 8
    assert text == llm.llm.get_tokenizer().decode(tokens)


def test_stop_string_cuts_the_text(llm: VllmRunner, reference: tuple[list[int], str]) -> None:
    tokens, text = reference
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop)
    decode = llm.llm.get_tokenizer().decode
    # Generation ends with the first token whose text completes the stop string.
    end = next(k for k in range(1, len(tokens) + 1) if stop in decode(tokens[:k]))
    out = run(llm, stop=[stop, "never-appears"])
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == tokens[:end]
    kept = run(llm, stop=stop, include_stop_str_in_output=True)
    assert kept.text == text[: cut + len(stop)]
    assert kept.token_ids == tokens[:end]


def test_stop_token_ends_without_its_text(
    llm: VllmRunner, reference: tuple[list[int], str]
) -> None:
    tokens, _ = reference
    stop_id = tokens[6]
    first = tokens.index(stop_id)
    out = run(llm, stop_token_ids=[stop_id])
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.text == llm.llm.get_tokenizer().decode(tokens[:first])


def test_min_tokens_holds_back_stops(llm: VllmRunner, reference: tuple[list[int], str]) -> None:
    tokens, _ = reference
    out = run(llm, stop_token_ids=[tokens[0], tokens[1]], min_tokens=10)
    assert len(out.token_ids) >= 10
    assert all(t not in (tokens[0], tokens[1]) for t in out.token_ids[:10])


def test_length_finish(llm: VllmRunner) -> None:
    out = run(llm)
    assert out.finish_reason == "length" and out.stop_reason is None
    assert len(out.token_ids) == 24
