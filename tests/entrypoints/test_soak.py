"""A bounded soak of a real server on the loopback: a few thousand mixed requests from
concurrent clients (completions, chat, streaming, echo with logprobs, client aborts and
disconnects, invalid inputs). No 5xx, every slot free at the end, no steady RSS growth (after a
warm-up, the second of two equal halves grows RSS by less than half what the first did, or by
under 1 KB per request), and the greedy output of a fixed prompt unchanged.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.conftest import MODEL_NAME, RunningServer, launch_server

WARM_UP = 400
HALF = 800  # requests in each measured half
NUM_REQUESTS = WARM_UP + 2 * HALF
CONCURRENCY = 16
TIME_LIMIT_S = 120
# Steady growth: the second half grows RSS as much as half the first or more, and by more than
# this per request. Measured (2 cores, Intel Xeon): 45 KB then 8 KB per request: still
# slowing, not yet bounded (see the README's memory notes); a constant per-request leak fails.
STEADY_BYTES_PER_REQUEST = 1024
GREEDY = {"model": MODEL_NAME, "prompt": "import os\n", "max_tokens": 12, "temperature": 0}
WORDS = ["def", "class", "import", "return", "self", "value", "for", "in", "print", "if"]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))


def _request(rng: random.Random) -> tuple[str, str, dict, int | None]:
    """(kind, path, body, expected status or None for an abort) of one random request."""
    kind = rng.choice(
        ["completion", "completion", "chat", "stream", "chat_stream", "echo", "abort", "invalid"]
    )
    common = {"model": MODEL_NAME, "max_tokens": rng.randint(1, 8), "temperature": 0.8}
    if kind in ("chat", "chat_stream"):
        messages = [{"role": "user", "content": _text(rng)}]
        body = {**common, "messages": messages, "stream": kind == "chat_stream"}
        return kind, "/v1/chat/completions", body, 200
    body = {**common, "prompt": _text(rng), "n": rng.choice([1, 1, 2])}
    if kind == "stream" or kind == "abort":
        body.update(stream=True, max_tokens=rng.randint(4, 32))
    elif kind == "echo":
        body.update(echo=True, logprobs=2, max_tokens=rng.choice([0, 3]))
    elif kind == "invalid":
        bad = rng.choice(
            [{"seed": 2**64}, {"top_k": 2**63}, {"prompt": "\ud800"}, {"stop_token_ids": [-1]}]
        )
        body.update(bad)
        return kind, "/v1/completions", body, 400
    return kind, "/v1/completions", body, None if kind == "abort" else 200


async def _one(client: httpx.AsyncClient, rng: random.Random, statuses: Counter) -> None:
    kind, path, body, want = _request(rng)
    content = json.dumps(body)
    headers = {"content-type": "application/json"}
    if want is None:  # read a little of the stream, then hang up
        async with client.stream("POST", path, content=content, headers=headers) as response:
            async for _ in response.aiter_lines():
                break
        statuses["abort"] += 1
        return
    response = await client.post(path, content=content, headers=headers)
    statuses[response.status_code] += 1
    assert response.status_code == want, (kind, body, response.text)
    if body.get("stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), response.text[-200:]


async def _soak(server: RunningServer, seed: int, count: int) -> Counter:
    rng = random.Random(seed)
    statuses: Counter = Counter()
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers, timeout=60, limits=limits
    ) as client:
        queue = list(range(count))

        async def worker() -> None:
            while queue:
                queue.pop()
                await _one(client, rng, statuses)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return statuses


def _metric(server: RunningServer, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"vllm:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def soak_server() -> Iterator[RunningServer]:
    with launch_server() as running:
        yield running


def test_soak(soak_server: RunningServer) -> None:
    server = soak_server
    greedy = httpx.post(f"{server.url}/v1/completions", json=GREEDY, headers=server.headers)
    want = greedy.json()["choices"][0]["text"]
    start = time.monotonic()
    statuses = asyncio.run(_soak(server, seed=1, count=WARM_UP))
    rss = [rss_bytes(server.process.pid)]
    for seed in (2, 3):
        statuses += asyncio.run(_soak(server, seed=seed, count=HALF))
        rss.append(rss_bytes(server.process.pid))
    assert time.monotonic() - start < TIME_LIMIT_S
    assert not [s for s in statuses if isinstance(s, int) and s >= 500], statuses
    assert statuses[200] > NUM_REQUESTS // 2 and statuses[400] > 0 and statuses["abort"] > 0
    deadline = time.monotonic() + 10
    while _metric(server, "state_slots_used") and time.monotonic() < deadline:
        time.sleep(0.2)  # aborts of hung-up streams land between steps
    assert _metric(server, "state_slots_used") == 0
    assert _metric(server, "num_requests_running") == _metric(server, "num_requests_waiting") == 0
    first, second = rss[1] - rss[0], rss[2] - rss[1]
    print(f"RSS growth per request: first half {first / HALF:.0f} B, second {second / HALF:.0f} B")
    bound = max(first / 2, STEADY_BYTES_PER_REQUEST * HALF)
    assert second < bound, f"steady RSS growth: {first} then {second} bytes"
    again = httpx.post(f"{server.url}/v1/completions", json=GREEDY, headers=server.headers)
    assert again.json()["choices"][0]["text"] == want
