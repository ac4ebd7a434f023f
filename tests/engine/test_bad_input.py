"""Bad input raises a clear error before entering the engine, and the engine serves on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(vllm_runner: type[VllmRunner]) -> Iterator[VllmRunner]:
    """One engine for the whole module: every test checks that it serves on."""
    with vllm_runner(tiny_model_dir("tied"), max_model_len=64, max_num_seqs=4) as runner:
        yield runner


@pytest.fixture(scope="module")
def normal_tokens(llm: VllmRunner) -> list[int]:
    return llm.generate_greedy("Hello world", 8)[0]


def assert_engine_healthy(llm: VllmRunner, normal_tokens: list[int]) -> None:
    llm.assert_drained()
    assert llm.generate_greedy("Hello world", 8) == [normal_tokens]


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("", "prompt is empty"),
        ({"prompt_token_ids": []}, "prompt is empty"),
        ("word " * 80, "max_model_len"),
        ({"prompt_token_ids": [5, 50280]}, "outside the vocabulary"),
        ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
        # Fields the engine does not use are named, not dropped (it would generate from the
        # text alone); images sent to a text model are refused.
        (
            {"prompt": "What is in it?", "multi_modal_data": {"image": b"png"}},
            "multi_modal_data: this model is served text-only",
        ),
        ({"prompt_token_ids": [5, 6], "mm_processor_kwargs": {}}, "'mm_processor_kwargs'"),
        ({"prompt": "hi", "prompt_token_ids": [5], "extra": None}, "'extra' not supported"),
    ],
)
def test_bad_prompt(llm: VllmRunner, normal_tokens: list[int], prompt, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt", prompt], GREEDY)
    assert_engine_healthy(llm, normal_tokens)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=9, max_tokens=8), "min_tokens"),
        (dict(logprobs=21), "logprobs"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
    ],
)
def test_bad_sampling_params(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**kwargs)


def test_n_above_slots_is_rejected(llm: VllmRunner, normal_tokens: list[int]) -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate("Hello", SamplingParams(n=5))
    assert_engine_healthy(llm, normal_tokens)


def test_params_list_length_mismatch(llm: VllmRunner, normal_tokens: list[int]) -> None:
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY])
    assert_engine_healthy(llm, normal_tokens)
