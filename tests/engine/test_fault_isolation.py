"""A failing step ends only its own requests and the engine goes on; values that pass the type
check but would overflow inside a step are refused at the door; a random mix of valid and
invalid requests never leaves the engine unable to serve, nor a slot or request behind.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.runners import VllmRunner, assert_drained
from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams
from vllm_mamba.errors import RequestsFailedError
from vllm_mamba.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPT = {"prompt_token_ids": [11, 22, 33, 44, 55]}


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    """One engine for the module; drained (every slot free) when the module ends."""
    with VllmRunner(tiny_model_dir("tied"), max_num_seqs=6, max_model_len=96) as runner:
        yield runner.llm


def _tokens(llm: LLM, prompt: Any = PROMPT) -> list[int]:
    return llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _fail_next_steps(monkeypatch: pytest.MonkeyPatch, count: int) -> list[int]:
    """Makes the next `count` forwards raise; returns a list that counts the failures."""
    real = ModelRunner.execute
    failures: list[int] = []

    def flaky(self: ModelRunner, step: Any) -> Any:
        if len(failures) < count:
            failures.append(1)
            raise RuntimeError("injected step failure")
        return real(self, step)

    monkeypatch.setattr(ModelRunner, "execute", flaky)
    return failures


def test_a_failed_step_fails_its_request_and_the_next_succeeds(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = _tokens(llm)
    _fail_next_steps(monkeypatch, 1)
    with pytest.raises(RequestsFailedError, match="injected step failure"):
        _tokens(llm)
    assert_drained(llm.llm_engine)
    assert _tokens(llm) == want
    assert_drained(llm.llm_engine)


def test_only_the_requests_of_the_failed_step_end(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.llm_engine
    want = _tokens(llm)
    engine.add_request("early", PROMPT, GREEDY)
    engine.step()  # "early" prefilled, holds a slot
    engine.add_request("late", {"prompt_token_ids": [7, 8, 9]}, GREEDY)
    _fail_next_steps(monkeypatch, 1)
    with pytest.raises(RequestsFailedError) as err:
        engine.step()
    assert sorted(err.value.request_ids) == ["early", "late"]
    assert_drained(engine)
    engine.add_request("after", PROMPT, GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.outputs[0].token_ids for o in outs] == [want]


@pytest.mark.parametrize(
    "params",
    [
        {"seed": 2**64},
        {"seed": -(2**63) - 1},
        {"seed": 10**30},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"repetition_penalty": math.nan},
        {"top_p": math.nan},
        {"n": True},
        {"stop_token_ids": [1.5]},
        {"stop": ["\ud800"]},
    ],
)
def test_out_of_range_sampling_params_are_value_errors(params: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{next(iter(params))}"):
        SamplingParams(**params)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"top_k": 2**63, "temperature": 1.0}, "top_k"),
        ({"top_k": 10**30}, "top_k"),
        ({"stop_token_ids": [99999], "min_tokens": 1}, "stop_token_ids"),
        ({"stop_token_ids": [-5000], "min_tokens": 1}, "stop_token_ids"),
        ({"stop_token_ids": [2**64], "min_tokens": 1}, "stop_token_ids"),
    ],
)
def test_values_outside_the_model_are_refused_at_the_door(
    llm: LLM, params: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        llm.generate(PROMPT, SamplingParams(max_tokens=4, **params), use_tqdm=False)
    assert_drained(llm.llm_engine)


@pytest.mark.parametrize("prompt", ["a\ud800b", "\udfff"])
def test_text_the_tokenizer_cannot_encode_is_a_value_error(llm: LLM, prompt: str) -> None:
    with pytest.raises(ValueError, match="not valid Unicode"):
        llm.generate(prompt, GREEDY, use_tqdm=False)


def test_largest_seed_with_n2_samples(llm: LLM) -> None:
    params = SamplingParams(seed=2**63 - 1, n=2, temperature=1.0, max_tokens=6)
    first = llm.generate(PROMPT, params, use_tqdm=False)[0]
    again = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert all(len(c.token_ids) == 6 for c in first.outputs)


def _random_request(rng: random.Random) -> tuple[Any, dict[str, Any]]:
    """A prompt and sampling kwargs, about half of them invalid in some way."""
    prompt: Any = {"prompt_token_ids": [rng.randrange(50280) for _ in range(rng.randint(1, 20))]}
    kwargs: dict[str, Any] = {
        "max_tokens": rng.randint(1, 8),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "n": rng.choice([1, 1, 2]),
    }
    if rng.random() < 0.5:
        key, value = rng.choice(
            [
                ("seed", rng.choice([2**64, -1, 2**63 - 1, 7])),
                ("top_k", rng.choice([2**63, 50281, 5])),
                ("stop_token_ids", [rng.choice([99999, -3, 2**64, 3])]),
                ("min_tokens", rng.choice([1, 100])),
                ("temperature", rng.choice([math.nan, -1.0, 0.5])),
                ("n", rng.choice([0, 7, 3])),
                ("prompt", rng.choice(["", "ok text", "bad \ud800", [], [50280], [-1]])),
            ]
        )
        if key == "prompt":
            prompt = value
        else:
            kwargs[key] = value
    return prompt, kwargs


def test_random_requests_never_take_the_engine_down(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Property test: random valid/invalid requests, aborts and injected step failures."""
    engine = llm.llm_engine
    want = _tokens(llm)
    rng = random.Random(1234)
    real = ModelRunner.execute

    def sometimes_failing(self: ModelRunner, step: Any) -> Any:
        if rng.random() < 0.05:
            raise RuntimeError("injected")
        return real(self, step)

    monkeypatch.setattr(ModelRunner, "execute", sometimes_failing)
    accepted = 0
    for i in range(150):
        prompt, kwargs = _random_request(rng)
        try:
            engine.add_request(f"r{i}", prompt, SamplingParams(**kwargs))
            accepted += 1
        except ValueError:
            pass
        if rng.random() < 0.1:
            engine.abort_request(f"r{rng.randrange(i + 1)}")
        for _ in range(rng.randint(0, 3)):
            try:
                engine.step()
            except RequestsFailedError:
                pass
    while engine.has_unfinished_requests():
        try:
            engine.step()
        except RequestsFailedError:
            pass
    assert accepted > 30
    assert_drained(engine)
    monkeypatch.setattr(ModelRunner, "execute", real)
    assert _tokens(llm) == want
