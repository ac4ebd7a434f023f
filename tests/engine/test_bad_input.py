"""Bad input raises a clear error before entering the engine, and the engine serves on."""

from __future__ import annotations

import functools

import pytest

from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@functools.cache
def llm() -> LLM:
    return LLM(tiny_model_dir("tied"), max_model_len=64, max_num_seqs=4)


@functools.cache
def normal_tokens() -> list[int]:
    return llm().generate("Hello world", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def assert_engine_healthy() -> None:
    engine = llm().llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.slots.num_used == 0
    out = llm().generate("Hello world", GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == normal_tokens()


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("", "prompt is empty"),
        ({"prompt_token_ids": []}, "prompt is empty"),
        ("word " * 80, "max_model_len"),
        ({"prompt_token_ids": [5, 50280]}, "outside the vocabulary"),
        ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
    ],
)
def test_bad_prompt(prompt, match: str) -> None:
    normal_tokens()
    with pytest.raises(ValueError, match=match):
        llm().generate(["fine prompt", prompt], GREEDY, use_tqdm=False)
    assert_engine_healthy()


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
    assert_engine_healthy()


def test_n_above_slots_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm().generate("Hello", SamplingParams(n=5), use_tqdm=False)
    assert_engine_healthy()


def test_params_list_length_mismatch() -> None:
    with pytest.raises(ValueError, match="sampling_params"):
        llm().generate(["a", "b"], [GREEDY], use_tqdm=False)
    assert_engine_healthy()
