"""Back-pressure against a real server: a request may not take more than its share of the
state slots (`n` times its prompts), and requests holding every slot leave room for a later
one. (Unread outputs and their stall timeout are tested on
the engine in tests/engine/test_async_back_pressure.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, RunningServer, launch_server

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


def test_requests_holding_every_slot_leave_room_for_a_later_one(server: RunningServer) -> None:
    """Issue 46: two requests of n = 32 hold all 64 slots; a request sent once both generate
    finishes before either (it used to queue until one had finished)."""
    big = {"prompt": "def add(a, b):", "max_tokens": 30, "n": 32, "temperature": 1.0}
    big["extra_body"] = {"ignore_eos": True}
    finished: list[str] = []

    async def run_big(api: openai.AsyncOpenAI, name: str, started: asyncio.Event) -> None:
        async for _ in await api.completions.create(model=MODEL_NAME, stream=True, **big):
            started.set()
        finished.append(name)

    async def run() -> None:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0
        ) as api:
            started = [asyncio.Event(), asyncio.Event()]
            bigs = [asyncio.create_task(run_big(api, f"big{i}", started[i])) for i in (0, 1)]
            await asyncio.gather(*(e.wait() for e in started))
            reply = await api.completions.create(model=MODEL_NAME, **COMPLETION)
            assert reply.choices[0].finish_reason in ("length", "stop")
            finished.append("small")
            await asyncio.gather(*bigs)

    asyncio.run(run())
    assert finished[0] == "small", finished
