"""`serve --tensor-parallel-size 2` answers as one rank does; a killed worker ends it cleanly.

One server (Mamba, 2 ranks, gloo) per module: its greedy completions equal `LLM.generate` on
one rank; then one worker process is killed (SIGKILL) while a long streamed completion runs:
the stream ends with an error, `/health` stops answering 200 and the server exits with status
1, each within a bounded time (no hang).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.conftest import _wait_healthy, start_server
from tests.helpers.prompts import make_prompts
from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams

DEATH_BOUND_S = 30.0  # the stream fails, /health fails and the server exits within this


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux /proc)."""
    kids: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(p) for p in f.read().split()]
    return kids


def _worker_pids(server_pid: int) -> list[int]:
    """The tensor-parallel workers: children of the server's multiprocessing fork server."""
    pids = []
    for child in _children(server_pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"forkserver" in f.read():
                pids += _children(child)
    return pids


@pytest.fixture(scope="module")
def tp_server() -> Iterator[tuple[subprocess.Popen, str]]:
    """A server on the tiny Mamba with `--tensor-parallel-size 2`."""
    cmd = [
        "--model", tiny_model_dir("tied"), "--served-model-name", "tp",
        "--max-model-len", "4096", "--max-num-seqs", "8", "--tensor-parallel-size", "2",
        "--device", "cpu", "--log-level", "warning",
    ]  # fmt: skip
    proc, port = start_server(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_completions_equal_one_rank(tp_server: tuple[subprocess.Popen, str]) -> None:
    _, url = tp_server
    prompts = make_prompts()[2:6]
    with VllmRunner(tiny_model_dir("tied"), device="cpu", max_num_seqs=8) as runner:
        ref = runner.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        )
    body = {"model": "tp", "prompt": prompts, "max_tokens": 10, "temperature": 0}
    body["ignore_eos"] = True
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    got = sorted(resp.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in got] == [r.outputs[0].text for r in ref]


def test_killed_worker_fails_requests_and_health(tp_server: tuple[subprocess.Popen, str]) -> None:
    proc, url = tp_server
    workers = _worker_pids(proc.pid)
    assert len(workers) == 1, workers
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": "tp", "prompt": [5, 6, 7], "max_tokens": 4000, "stream": True}
        body["ignore_eos"] = True
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
        except httpx.HTTPError as err:  # the server went away mid-stream
            events.append(f"transport error: {err!r}")
        started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    killed = time.monotonic()
    os.kill(workers[0], signal.SIGKILL)
    reader.join(DEATH_BOUND_S)
    assert not reader.is_alive(), "the stream did not end after the worker died"
    finished = [json.loads(e) for e in events if e.startswith("{") and '"finish_reason"' in e]
    assert not any(c["choices"][0]["finish_reason"] for c in finished if c.get("choices"))
    assert any('"error"' in e for e in events[-2:]), events[-3:]
    while time.monotonic() - killed < DEATH_BOUND_S:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code != 200:
                break
        except httpx.HTTPError:
            break  # the server is gone
        time.sleep(0.2)
    else:
        pytest.fail("/health still answers 200 after the worker died")
    assert proc.wait(DEATH_BOUND_S) == 1
