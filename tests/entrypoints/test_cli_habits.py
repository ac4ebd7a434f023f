"""The `vllm-mamba` command behaves as vLLM's and the usual local-model tools' do: a fast
`--version` / `--help` without torch, `serve MODEL` or `serve --model MODEL`, help with one
default per flag, `generate` reading standard input, Ctrl-C in `chat` stopping only the reply;
and the server's 400 when prompt plus `max_tokens` exceeds the model length (vLLM's message).
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from tests.entrypoints.conftest import MAX_MODEL_LEN, MODEL_NAME, RunningServer
from vllm_mamba.entrypoints.cli import build_parser

CLI = [sys.executable, "-m", "vllm_mamba.entrypoints.cli"]
SERVER_ONLY = ("--host", "--port", "--api-key", "--served-model-name", "--max-request-bytes")


def _cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, **kwargs)


@pytest.mark.whole_machine  # a wall-clock bound
def test_version_is_fast() -> None:
    def once() -> float:
        start = time.perf_counter()
        done = _cli("--version")
        elapsed = time.perf_counter() - start
        assert done.returncode == 0 and done.stdout.startswith("vllm-mamba "), done.stderr
        return elapsed

    runs = [once() for _ in range(3)]
    assert statistics.median(runs) < 1.0, runs


def test_help_and_version_import_no_torch() -> None:
    code = (
        "import sys\n"
        "import vllm_mamba.entrypoints.cli as cli\n"
        "assert 'torch' not in sys.modules, 'import'\n"
        "for argv in (['--help'], ['--version']):\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    assert 'torch' not in sys.modules, argv\n"
        "print('no torch')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("no torch")
    assert "serve" in done.stdout and "generate" in done.stdout  # --help lists them


def _help_entries(text: str) -> dict[str, str]:
    """Each flag's help text in `--help` output, joined onto one line."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"^  (-{1,2}[\w-]+|[A-Z]+)\b(.*)$", line)
        if match:
            current = match.group(1)
            entries[current] = match.group(2).strip()
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_help_shows_one_default_per_flag(command: str) -> None:
    done = _cli(command, "--help")
    assert done.returncode == 0, done.stderr
    assert "default: None" not in done.stdout
    entries = _help_entries(done.stdout)
    assert "--max-model-len" in entries and "--model" in entries
    for flag, text in entries.items():
        assert text.count("default") <= 1, (flag, text)
    assert "(default: auto)" in entries["--dtype"]
    assert "(default: None)" not in entries["--tokenizer"]
    if command == "serve":
        for flag in SERVER_ONLY:
            assert flag in entries
    else:  # no server flags where there is no server
        for flag in SERVER_ONLY:
            assert flag not in entries, flag
        assert "sampling:" in done.stdout and "engine:" in done.stdout


def test_serve_takes_the_model_either_way() -> None:
    parser = build_parser("serve")
    for argv in (["serve", "some/model"], ["serve", "--model", "some/model"]):
        args = parser.parse_args([*argv, "--port", "9001"])
        assert args.model == "some/model" and args.port == 9001
    same = parser.parse_args(["serve", "some/model", "--model", "some/model"])
    assert same.model == "some/model"
    assert parser.parse_args(["serve"]).model is None  # refused when it runs (below)
    done = _cli("serve", "a/model", "--model", "b/model")
    assert done.returncode == 2 and "two different models" in done.stderr
    done = _cli("serve")
    assert done.returncode == 2 and "a model is required" in done.stderr


def test_chat_and_generate_take_the_model_either_way() -> None:
    chat = build_parser("chat")
    assert chat.parse_args(["chat", "a/b"]).model == "a/b"
    assert chat.parse_args(["chat", "--model", "a/b"]).model == "a/b"
    from vllm_mamba.entrypoints.generate import resolve_prompts

    gen = build_parser("generate")
    args = gen.parse_args(["generate", "a/b", "def f():", "import os"])
    assert resolve_prompts(args) == ["def f():", "import os"] and args.model == "a/b"
    args = gen.parse_args(["generate", "def f():", "--model", "a/b"])
    assert resolve_prompts(args) == ["def f():"] and args.model == "a/b"
    args = gen.parse_args(["generate", "def f():"])  # not a model: the shipped one
    assert resolve_prompts(args) == ["def f():"] and args.model == "vllm-mamba/tiny-stdlib"


def test_generate_reads_standard_input() -> None:
    common = ["vllm-mamba/tiny-stdlib", "--max-tokens", "8", "--max-num-seqs", "2"]
    piped = _cli("generate", *common, input="class Foo:\n    def bar(self):\n")
    assert piped.returncode == 0, piped.stderr
    assert "--- 'class Foo:\\n    def bar(self):'\n" in piped.stdout  # all of it, one prompt
    assert piped.stdout.splitlines()[-1].startswith("1 prompt(s), 8 tokens")
    dash = _cli("generate", *common, "-", input="class Foo:\n    def bar(self):\n")
    assert dash.returncode == 0, dash.stderr
    assert dash.stdout.split("\n\n")[0] == piped.stdout.split("\n\n")[0]  # the same output


def test_generate_system_needs_a_chat_template() -> None:
    from tests.tiny_models import tiny_model_dir

    common = ["--max-tokens", "4", "--max-num-seqs", "2", "--system", "Helpers."]
    done = _cli("generate", "--model", tiny_model_dir("tied"), "def f():", *common)
    assert done.returncode == 2 and "--system needs a chat template" in done.stderr
    done = _cli("generate", "vllm-mamba/tiny-stdlib", "def f():", *common, "--stop", "\n")
    assert done.returncode == 0, done.stderr
    assert "--- 'def f():'\n" in done.stdout


def test_chat_ctrl_c_stops_the_reply_and_keeps_the_session() -> None:
    cmd = [*CLI, "chat", "vllm-mamba/tiny-stdlib", "--temperature", "1.0", "--seed", "1"]
    cmd += ["--max-tokens", "60000", "--max-model-len", "65536", "--max-num-seqs", "2"]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        seen = b""
        while b"> " not in seen:  # the model is loaded, the first prompt is shown
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, proc.stderr.read() if proc.stderr else ""
            seen += chunk
        proc.stdin.write(b"def reverse(text):\n")
        proc.stdin.flush()
        reply = b""
        while len(reply) < 40:  # the reply is streaming
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, proc.stderr.read() if proc.stderr else ""
            reply += chunk
        proc.send_signal(signal.SIGINT)
        while b"(interrupted)\n> " not in reply:
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, reply
            reply += chunk
        proc.stdin.close()  # Ctrl-D at the prompt leaves
        code = proc.wait(timeout=60)
        err = proc.stderr.read().decode() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_server_refuses_max_tokens_beyond_the_model_length(server: RunningServer) -> None:
    prompt = list(range(3, 13))
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 100000}
    got = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers)
    assert got.status_code == 400
    error = got.json()["error"]
    assert error["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: 100000. This model's maximum "
        f"context length is {MAX_MODEL_LEN} tokens and your request has 10 input tokens "
        f"(100000 > {MAX_MODEL_LEN} - 10)."
    )
    assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
    chat = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": MAX_MODEL_LEN,
    }
    got = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=server.headers)
    assert got.status_code == 400 and got.json()["error"]["param"] == "max_tokens"
    assert "maximum context length is" in got.json()["error"]["message"]
    long = {"model": MODEL_NAME, "prompt": [5] * (MAX_MODEL_LEN - 4), "max_tokens": 4}
    got = httpx.post(f"{server.url}/v1/completions", json=long, headers=server.headers)
    assert got.status_code == 200, got.text  # exactly what is left is fine
    assert got.json()["usage"]["completion_tokens"] <= 4
