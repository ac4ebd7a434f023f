"""Stop strings, stop tokens, min_tokens and the text they leave, against a plain greedy run."""

from __future__ import annotations

import functools

from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams

PROMPT = "The history of the"


@functools.cache
def llm() -> LLM:
    return LLM(tiny_model_dir("tied"))


@functools.cache
def reference() -> tuple[list[int], str]:
    """24 greedy tokens and their text, with no stop condition."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = llm().generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, out.text


def run(**kwargs):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kwargs)
    return llm().generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


def test_text_is_the_decoded_tokens() -> None:
    tokens, text = reference()
    assert text == llm().get_tokenizer().decode(tokens)
    assert len(set(tokens)) > 8


def test_stop_string_cuts_the_text() -> None:
    tokens, text = reference()
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop)
    out = run(stop=[stop, "never-appears"])
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == tokens[: len(out.token_ids)]
    kept = run(stop=stop, include_stop_str_in_output=True)
    assert kept.text == text[: cut + len(stop)]


def test_stop_token_ends_without_its_text() -> None:
    tokens, text = reference()
    stop_id = tokens[6]
    first = tokens.index(stop_id)
    out = run(stop_token_ids=[stop_id])
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.text == llm().get_tokenizer().decode(tokens[:first])


def test_min_tokens_holds_back_stops() -> None:
    tokens, _ = reference()
    out = run(stop_token_ids=[tokens[0], tokens[1]], min_tokens=10)
    assert len(out.token_ids) >= 10
    assert all(t not in (tokens[0], tokens[1]) for t in out.token_ids[:10])


def test_length_finish() -> None:
    out = run()
    assert out.finish_reason == "length" and out.stop_reason is None
    assert len(out.token_ids) == 24
