"""A bounded soak of a real server on the loopback: a few thousand mixed requests from
concurrent clients (completions, chat, streaming, echo with logprobs, client aborts and
disconnects, invalid inputs). No 5xx, every slot free at the end, RSS growth per request under
a bound, and the greedy output of a fixed prompt unchanged.
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

NUM_REQUESTS = 2000
CONCURRENCY = 16
TIME_LIMIT_S = 300
# A gross guard: allocator arenas of the server's threads still grow after the warm-up half
# (up to ~11 KB per request seen on CI, 28.7 KB once in three fresh-clone runs on a quiet
# machine, the same code passing on rerun); leaks of per-request bookkeeping are caught exactly
# by tests/entrypoints/test_fault_isolation_server.py.
RSS_BYTES_PER_REQUEST = 49152
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
    warm = NUM_REQUESTS // 2
    first = asyncio.run(_soak(server, seed=1, count=warm))
    rss_before = rss_bytes(server.process.pid)
    rest = asyncio.run(_soak(server, seed=2, count=NUM_REQUESTS - warm))
    rss_after = rss_bytes(server.process.pid)
    statuses = first + rest
    assert time.monotonic() - start < TIME_LIMIT_S
    assert not [s for s in statuses if isinstance(s, int) and s >= 500], statuses
    assert statuses[200] > NUM_REQUESTS // 2 and statuses[400] > 0 and statuses["abort"] > 0
    deadline = time.monotonic() + 10
    while _metric(server, "state_slots_used") and time.monotonic() < deadline:
        time.sleep(0.2)  # aborts of hung-up streams land between steps
    assert _metric(server, "state_slots_used") == 0
    assert _metric(server, "num_requests_running") == _metric(server, "num_requests_waiting") == 0
    growth = rss_after - rss_before
    assert growth < RSS_BYTES_PER_REQUEST * (NUM_REQUESTS - warm), f"RSS grew {growth} bytes"
    again = httpx.post(f"{server.url}/v1/completions", json=GREEDY, headers=server.headers)
    assert again.json()["choices"][0]["text"] == want
