"""The server in-process (FastAPI's TestClient): a step that raises fails only its request with
a 500 in OpenAI's shape, the next request succeeds, `/health` stays 200 and nothing is left
behind; an unrecoverable failure makes `/health` say so and asks the process to exit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.entrypoints.conftest import ROLE_CONTENT_TEMPLATE
from tests.helpers.runners import VllmRunner, assert_drained
from tests.tiny_models import tiny_model_dir
from vllm_mamba.engine.async_engine import AsyncLLMEngine
from vllm_mamba.engine.llm_engine import LLMEngine
from vllm_mamba.engine.scheduler import Scheduler
from vllm_mamba.entrypoints.cli import build_parser
from vllm_mamba.entrypoints.openai.api_server import build_app
from vllm_mamba.worker.model_runner import ModelRunner

BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def llm_engine() -> Iterator[LLMEngine]:
    """One engine for the module (a `VllmRunner`'s: drained when the module ends)."""
    with VllmRunner(tiny_model_dir("tied"), max_num_seqs=4, max_model_len=128) as runner:
        yield runner.engine


class Served:
    """A TestClient on the app, its engine, and what `on_dead` received."""

    def __init__(self, engine: LLMEngine) -> None:
        self.dead: list[BaseException] = []
        self.engine = AsyncLLMEngine(engine, on_dead=self.dead.append)
        model = engine.config.model_config.model
        args = build_parser().parse_args(["serve", model, "--chat-template", ROLE_CONTENT_TEMPLATE])
        self.client = TestClient(build_app(self.engine, args))

    def completion(self, **overrides: Any) -> Any:
        # json.dumps escapes lone surrogates as `\ud800`, which the client's encoder refuses.
        body = json.dumps({**BODY, **overrides})
        headers = {"content-type": "application/json"}
        return self.client.post("/v1/completions", content=body, headers=headers)

    def assert_clean(self) -> None:
        assert self.client.get("/health").status_code == 200
        assert self.engine.num_requests == 0
        assert_drained(self.engine.engine)


@pytest.fixture
def served(llm_engine: LLMEngine) -> Iterator[Served]:
    served = Served(llm_engine)
    with served.client:
        yield served


def _fail_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ModelRunner.execute
    calls: list[int] = []

    def flaky(self: ModelRunner, step: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        return real(self, step)

    monkeypatch.setattr(ModelRunner, "execute", flaky)


def test_failed_step_is_a_500_and_the_server_goes_on(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = served.completion().json()["choices"][0]["text"]
    _fail_next_step(monkeypatch)
    failed = served.completion()
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["type"] == "server_error" and "injected step failure" in error["message"]
    served.assert_clean()
    assert served.completion().json()["choices"][0]["text"] == want
    served.assert_clean()


def test_failed_step_ends_a_stream_with_an_error_event(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fail_next_step(monkeypatch)
    response = served.completion(stream=True)
    assert response.status_code == 200
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 500
    served.assert_clean()
    assert served.completion().status_code == 200


def test_no_bookkeeping_is_left_after_every_kind_of_request(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for _ in range(3):
        assert served.completion().status_code == 200
        assert served.completion(stream=True, n=2, temperature=1.0).status_code == 200
        assert served.client.post("/v1/chat/completions", json=chat).status_code == 200
        streamed = served.client.post("/v1/chat/completions", json={**chat, "stream": True})
        assert streamed.status_code == 200
        assert served.completion(seed=2**64).status_code == 400
        assert served.completion(prompt="\ud800").status_code == 400
        assert served.completion(echo=True, max_tokens=0, logprobs=1).status_code == 200
    _fail_next_step(monkeypatch)
    assert served.completion().status_code == 500
    served.assert_clean()


def test_unrecoverable_failure_marks_the_server_unhealthy(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Scheduler) -> Any:
        raise RuntimeError("scheduler state is corrupt")

    monkeypatch.setattr(Scheduler, "schedule", broken)
    assert served.completion().status_code in (500, 503)
    assert [repr(e) for e in served.dead] == [repr(RuntimeError("scheduler state is corrupt"))]
    assert served.client.get("/health").status_code == 503
    assert served.completion().status_code == 503
