"""Slow readers against a real server: streaming clients that stop reading (raw sockets with a
small receive buffer, never read) neither hold up another client's completion, whose latency is
measured against its idle latency while they stall (their requests are paused), nor keep their
state slots: after `--stream-stall-timeout` their requests are aborted and every slot is free
again while their connections are still open. (The engine's side:
tests/engine/test_async_back_pressure.py.)"""

from __future__ import annotations

import json
import socket
import statistics
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, RunningServer, launch_server

pytestmark = pytest.mark.whole_machine  # latency ratios with and without stalled readers

STALL_TIMEOUT_S = 5.0
STALLED_CLIENTS = 4
N = 8  # sequences per stalled request: 32 slots of 64 in all
# The first events echo a long prompt with its logprobs in every choice: megabytes at once,
# more than the sockets' buffers hold (the kernel's grow to a few MB on the loopback), so the
# stream blocks at once and the stall timeout, not the buffers' size, decides.
PROMPT_TOKENS = 2000
MAX_TOKENS = 2000
PROBE = {"model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}
# A stalled request is paused once its output waits unread for a fraction of a second (its 8
# sequences keep their slots but no longer decode), so the probe runs nearly alone: a few times
# its idle latency (measured 51-96 ms against 39-48 ms idle on 2 shared cores; 468-601 ms when
# they kept decoding until the timeout). Once they are aborted: a few times idle too.
STALLED_LATENCY_FACTOR = 4
FREED_LATENCY_FACTOR = 3
LATENCY_FLOOR_S = 0.25  # below this, timer noise on a shared machine


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with launch_server("--stream-stall-timeout", str(STALL_TIMEOUT_S)) as running:
        yield running


def _metric(server: RunningServer, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"vllm:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _probe_latency(server: RunningServer) -> float:
    """The median latency of three probe completions, each checked."""
    latencies = []
    for _ in range(3):
        start = time.monotonic()
        response = httpx.post(
            f"{server.url}/v1/completions", json=PROBE, headers=server.headers, timeout=60
        )
        latencies.append(time.monotonic() - start)
        assert response.status_code == 200, response.text
    return statistics.median(latencies)


def _stalled_stream(server: RunningServer) -> socket.socket:
    """A streaming request with `n=N` on a socket that is never read."""
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "prompt": [5] * PROMPT_TOKENS,
            "n": N,
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "echo": True,
            "logprobs": 5,
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    port = int(server.url.rsplit(":", 1)[1])
    sock.connect(("127.0.0.1", port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def test_stalled_streams_hold_up_no_one_and_free_their_slots(server: RunningServer) -> None:
    _probe_latency(server)  # warm
    idle = _probe_latency(server)
    sockets = [_stalled_stream(server) for _ in range(STALLED_CLIENTS)]
    try:
        deadline = time.monotonic() + 30
        while _metric(server, "state_slots_used") < STALLED_CLIENTS * N:
            assert time.monotonic() < deadline, "the stalled requests never all ran"
            time.sleep(0.05)
        all_running = time.monotonic()
        stalled = _probe_latency(server)
        # Aborted after the stall timeout, the sockets still open and unread.
        deadline = all_running + STALL_TIMEOUT_S + 10
        while _metric(server, "state_slots_used"):
            assert time.monotonic() < deadline, "the stalled requests kept their slots"
            time.sleep(0.1)
        freed_after = time.monotonic() - all_running
        assert _metric(server, "num_requests_running") == 0
        assert _metric(server, "num_requests_waiting") == 0
        freed = _probe_latency(server)
    finally:
        for sock in sockets:
            sock.close()
    print(
        f"probe latency: idle {idle * 1000:.0f} ms, with stalled readers {stalled * 1000:.0f} ms,"
        f" after their abort {freed * 1000:.0f} ms; slots free {freed_after:.1f} s after all ran"
    )
    assert stalled < max(STALLED_LATENCY_FACTOR * idle, LATENCY_FLOOR_S), (idle, stalled)
    assert freed < max(FREED_LATENCY_FACTOR * idle, LATENCY_FLOOR_S), (idle, freed)
