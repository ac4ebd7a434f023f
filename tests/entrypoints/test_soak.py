"""A bounded soak of a real server on the loopback: a few thousand mixed requests from
concurrent clients (completions, chat, streaming, echo with logprobs, client aborts and
disconnects, invalid inputs). No 5xx, every slot free at the end, no steady memory growth in the
second half, and the greedy output of a fixed prompt unchanged.

Memory is sampled at quiescent points after every block of requests (no request in flight,
after the engine's idle `malloc_trim`, so RSS does not carry freed pages kept in the heap),
each sample the median of a few readings, and the growth per request of a half is the
median slope between its samples, not the difference of two endpoints. Both the server's
native heap in use (glibc's `mallinfo2`, `vllm:native_heap_in_use_bytes`) and its RSS are
compared by halves: the second half grows less than `BYTES_PER_REQUEST` per request on each,
and no faster than the first half did (no trend). Python's allocated blocks are reported.
Reference cycles that closed connections leave behind are collected soon because the server
freezes its startup heap (`native_memory.freeze_startup_heap`): a second half of +78 B/request
of RSS where it was +359 without the freeze (+594 and +356 by least squares), the heap flat.

Bounded caches that mixed traffic fills late are warmed first. oneDNN compiles a GEMM
primitive per row count (`ops.cpu_kernels.gemm_rows`: 20 sizes, 2.3 MB of heap each for the
tiny model's weights), so the warm-up sends one prompt of each size (echoed with logprobs, so
the LM head sees it too). It also keys them by the thread count they run on: each thread count
the CPU governor moves to (`worker.cpu_threads`, when other processes take CPUs) compiles them
all again (55 MB more heap on the shipped tiny-stdlib model), bounded by the counts the
governor visits. That is no growth per request, so the server runs a fixed thread count
(`--threads`, the count it would start with): on a shared machine the governor would put a
step of tens of MB anywhere in the soak.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.conftest import MODEL_NAME, RunningServer, launch_server
from vllm_mamba.ops.cpu_kernels import GEMM_ROWS, gemm_rows
from vllm_mamba.worker.cpu_threads import default_threads

pytestmark = pytest.mark.whole_machine  # a soak: time and memory bounds over 2,000 requests

WARMUP = 600
BLOCK = 100
BLOCKS_PER_HALF = 8
CONCURRENCY = 16
TIME_LIMIT_S = 300
# Growth per request of the heap and of RSS over the second half (fitted slope), see the
# module docstring.
BYTES_PER_REQUEST = 500
READINGS = 3
GREEDY = {"model": MODEL_NAME, "prompt": "import os\n", "max_tokens": 12, "temperature": 0}
WORDS = ["def", "class", "import", "return", "self", "value", "for", "in", "print", "if"]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Rss")


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
    with launch_server("--threads", str(default_threads())) as running:
        yield running


def _drained(server: RunningServer) -> None:
    deadline = time.monotonic() + 10
    while _metric(server, "state_slots_used") and time.monotonic() < deadline:
        time.sleep(0.2)  # aborts of hung-up streams land between steps
    assert _metric(server, "state_slots_used") == 0
    assert _metric(server, "num_requests_running") == _metric(server, "num_requests_waiting") == 0


def _metrics(server: RunningServer) -> dict[str, float]:
    """The value of each labelled `vllm:` metric line, by name (the last line of a name)."""
    values = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:") and "{" in line:
            values[line[5 : line.index("{")]] = float(line.rsplit(" ", 1)[1])
    return values


def _sample(server: RunningServer) -> tuple[float, float, float]:
    """(heap bytes in use, RSS bytes, Python blocks) of the quiescent server after the
    engine's idle `malloc_trim` (which moves RSS, not the heap in use), each the median of
    `READINGS` readings."""
    _drained(server)
    # The engine trims at most once a second; a lone request after that gap ends in an idle
    # trim.
    time.sleep(1.1)
    httpx.post(f"{server.url}/v1/completions", json=GREEDY, headers=server.headers)
    _drained(server)
    readings = []
    for _ in range(READINGS):
        values = _metrics(server)
        heap, blocks = values["native_heap_in_use_bytes"], values["python_allocated_blocks"]
        readings.append((heap, float(rss_bytes(server.process.pid)), blocks))
        time.sleep(0.05)
    return tuple(statistics.median(column) for column in zip(*readings))


def _growth(values: list[float]) -> float:
    """Growth per request of `values`, sampled every `BLOCK` requests: the median of the
    slopes between every two samples (Theil-Sen). RSS now and then drops by a few MB at one
    sample (the kernel reclaiming idle pages) and is back at the next, which swings a
    least-squares slope by KB per request; the median slope is the trend of the others."""
    slopes = [
        (values[j] - values[i]) / (BLOCK * (j - i))
        for i in range(len(values))
        for j in range(i + 1, len(values))
    ]
    return statistics.median(slopes)


def _warm_gemm_shapes(server: RunningServer) -> None:
    """One prompt of each of oneDNN's padded row counts, alone on the engine."""
    for rows in sorted({gemm_rows(m) for m in range(1, GEMM_ROWS + 1)}):
        body = {**GREEDY, "prompt": [5] * rows, "max_tokens": 1, "echo": True, "logprobs": 1}
        response = httpx.post(
            f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60
        )
        assert response.status_code == 200, response.text


def test_soak(soak_server: RunningServer) -> None:
    server = soak_server
    greedy = httpx.post(f"{server.url}/v1/completions", json=GREEDY, headers=server.headers)
    want = greedy.json()["choices"][0]["text"]
    start = time.monotonic()
    _warm_gemm_shapes(server)
    statuses = asyncio.run(_soak(server, seed=1, count=WARMUP))
    done = 0
    samples = [_sample(server)]
    for block in range(2 * BLOCKS_PER_HALF):
        statuses += asyncio.run(_soak(server, seed=2 + block, count=BLOCK))
        done += BLOCK
        samples.append(_sample(server))
    assert time.monotonic() - start < TIME_LIMIT_S
    total = WARMUP + done
    assert not [s for s in statuses if isinstance(s, int) and s >= 500], statuses
    assert statuses[200] > total // 2 and statuses[400] > 0 and statuses["abort"] > 0
    mid = BLOCKS_PER_HALF + 1
    halves = {"first": samples[:mid], "second": samples[mid - 1 :]}
    growth = {
        (half, name): _growth([sample[i] for sample in part])
        for half, part in halves.items()
        for i, name in enumerate(("heap", "rss", "blocks"))
    }
    report = ", ".join(f"{half} {name} {value:+.1f}" for (half, name), value in growth.items())
    heaps, rss = [int(sample[0]) for sample in samples], [int(sample[1]) for sample in samples]
    print(f"per request after {WARMUP} warm-up: {report}; heap samples {heaps}; rss {rss}")
    for name in ("heap", "rss"):
        first, second = growth["first", name], growth["second", name]
        assert second < BYTES_PER_REQUEST, (name, report, heaps, rss)
        assert second <= max(first, 0.0) + BYTES_PER_REQUEST / 2, (name, report, heaps, rss)
    again = httpx.post(f"{server.url}/v1/completions", json=GREEDY, headers=server.headers)
    assert again.json()["choices"][0]["text"] == want
