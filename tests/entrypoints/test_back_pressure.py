"""Back-pressure against a real server: a request may not take more than its share of the
state slots (`n` times its prompts). (Unread outputs and their stall timeout are tested on
the engine in tests/engine/test_async_back_pressure.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.conftest import RunningServer, launch_server

COMPLETION = {"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with launch_server() as running:  # 64 slots: one request may take 32
        yield running


def post(server: RunningServer, body: dict) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=120
    )


@pytest.mark.parametrize(("prompts", "n"), [(1, 33), (4, 10)])
def test_one_request_may_not_take_most_slots(server: RunningServer, prompts: int, n: int) -> None:
    response = post(server, {**COMPLETION, "prompt": ["hi"] * prompts, "n": n})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "n"
    assert post(server, {**COMPLETION, "n": 32}).status_code == 200
