"""A real server for the entrypoint tests: `python -m vllm_mamba.entrypoints.openai.api_server`
on the tiny `tied` model, on 127.0.0.1 and a free port, started once per module (or with extra
flags by `launch_server`) and stopped with SIGTERM (which must shut it down cleanly).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.tiny_models import tiny_model_dir

MODEL_NAME = "tiny-mamba"
API_KEY = "test-key"
MAX_MODEL_LEN = 4096
START_TIMEOUT_S = 180
# The tiny models have no chat template; the test servers chat with `role: content` lines.
ROLE_CONTENT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass
class RunningServer:
    """A server subprocess and how to reach it."""

    process: subprocess.Popen
    url: str
    model_dir: str

    @property
    def headers(self) -> dict[str, str]:
        """Headers with the right API key."""
        return {"Authorization": f"Bearer {API_KEY}"}


def listening_socket() -> socket.socket:
    """A TCP socket listening on 127.0.0.1 and a port the kernel chose, inheritable: a server
    started with `--fd` (`server_command`) serves on it, so no other process (a parallel test
    worker) can take the port between choosing it and the server's start."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # As the server's own `bind_socket`: connections it closes first leave TIME_WAIT entries
    # that inherit this flag, and only then may the port be bound again at once.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A port held bound but not listening while the block runs: connecting to it is refused,
    and no other process can start listening there meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def start_server(cmd: list[str], **popen: Any) -> tuple[subprocess.Popen, int]:
    """Starts `python -m vllm_mamba.entrypoints.openai.api_server` with the arguments `cmd`
    on a socket bound here (`--fd`); returns the process and its port."""
    sock = listening_socket()
    try:
        fd, port = sock.fileno(), sock.getsockname()[1]
        argv = [sys.executable, "-m", "vllm_mamba.entrypoints.openai.api_server", *cmd]
        proc = subprocess.Popen([*argv, "--fd", str(fd)], pass_fds=(fd,), **popen)
    finally:
        sock.close()  # the server holds its own copy
    return proc, port


def _wait_healthy(proc: subprocess.Popen, url: str, verify: ssl.SSLContext | bool = True) -> None:
    """Returns once `/health` answers 200. The socket listens from before the server starts,
    so a request waits in its backlog and is answered the moment the server serves (a server
    that exits closes it: the request fails at once)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while (left := deadline - time.monotonic()) > 0:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=min(left, 10), verify=verify).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("the server did not become healthy")


def greedy_completions(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Each prompt's greedy completion text from the server at `url`, all requests at once
    (the official `openai` client, one thread each)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)

    def complete(prompt: str) -> str:
        reply = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0
        )
        return reply.choices[0].text

    with ThreadPoolExecutor(max(len(prompts), 1)) as pool:
        return list(pool.map(complete, prompts))


@contextlib.contextmanager
def launch_server(
    *extra_args: str, model_dir: str | None = None, https_ca: str | None = None
) -> Iterator[RunningServer]:
    """Runs a server on a tiny model (default: the "tied" Mamba) with `extra_args` added to
    the default flags; on exit, SIGTERM must stop it cleanly and free the port.

    `https_ca`: the server serves https (`extra_args` hold its TLS flags); its certificate
    verifies with this CA file, and the url is `https://`."""
    model_dir = model_dir or tiny_model_dir("tied")
    cmd = [
        "--model",
        model_dir,
        "--served-model-name",
        MODEL_NAME,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "64",
        "--log-level",
        "warning",
        "--chat-template",
        ROLE_CONTENT_TEMPLATE,
        *extra_args,
    ]
    env = {**os.environ, "VLLM_MAMBA_API_KEY": API_KEY}
    proc, port = start_server(cmd, env=env)
    url = f"{'https' if https_ca else 'http'}://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, ssl.create_default_context(cafile=https_ca) if https_ca else True)
        yield RunningServer(proc, url, model_dir)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    # uvicorn re-raises the signal once its graceful shutdown is done, so the exit status is
    # the signal's (a failed shutdown would exit with 1, or hang).
    assert code in (0, -signal.SIGTERM), f"the server exited with {code} after SIGTERM"
    with socket.socket() as sock:
        # SO_REUSEADDR: connections the server closed may sit in TIME_WAIT on the port; the
        # bind still fails while anything listens there.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))  # the port is released


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """A running server with the default flags, one per test module."""
    with launch_server() as running:
        yield running
