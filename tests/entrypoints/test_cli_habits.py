"""The `vllm-mamba` command behaves as vLLM's and the usual local-model tools' do: a fast
`--version` / `--help` (every subcommand's too) without torch, `serve MODEL` or `serve --model
MODEL` (the shipped model by default), no abbreviated flags, one error format, help with one
default per flag, `generate` reading standard input and refusing a model path that is not
there, logs kept out of the streamed text, Ctrl-C in `chat` stopping only the reply; and the
server's 400 when prompt plus `max_tokens` exceeds the model length (vLLM's message).
"""

from __future__ import annotations

import io
import logging
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
from vllm_mamba.entrypoints.cli import build_parser, main
from vllm_mamba.entrypoints.cli_args import names_a_model
from vllm_mamba.logger import LineHandler, StreamedText
from vllm_mamba.model_zoo import DEFAULT_MODEL

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


def test_help_version_and_flag_typos_import_no_torch() -> None:
    """Every subcommand's `--help`, and a mistyped flag, answer without torch, transformers
    or the engine: as fast as `vllm-mamba --help` (they took 2.5 s)."""
    code = (
        "import sys\n"
        "import vllm_mamba.entrypoints.cli as cli\n"
        "assert 'torch' not in sys.modules, 'import'\n"
        "for argv in (['--help'], ['--version'], ['serve', '--help'], ['generate', '--help'],\n"
        "             ['chat', '--help'], ['models', '--help'], ['bench', '--help'],\n"
        "             ['bench', 'latency', '--help'], ['bench', 'throughput', '--help'],\n"
        "             ['bench', 'serve', '--help'], ['generate', '--max-token', '10'],\n"
        "             ['serve', '--prot']):\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code == (0 if argv[-1] in ('--help', '--version') else 2), argv\n"
        "    heavy = [m for m in ('torch', 'transformers', 'vllm_mamba.llm') if m in sys.modules]\n"
        "    assert not heavy, (argv, heavy)\n"
        "print('no torch')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("no torch")
    assert "serve" in done.stdout and "generate" in done.stdout  # --help lists them
    assert "error: unrecognized arguments: --max-token" in done.stderr
    assert "error: unrecognized arguments: --prot" in done.stderr


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


def test_serve_takes_the_model_either_way(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser("serve")
    for argv in (["serve", "some/model"], ["serve", "--model", "some/model"]):
        args = parser.parse_args([*argv, "--port", "9001"])
        assert args.model == "some/model" and args.port == 9001
    same = parser.parse_args(["serve", "some/model", "--model", "some/model"])
    assert same.model == "some/model"
    assert parser.parse_args(["serve"]).model == DEFAULT_MODEL  # as every other subcommand
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "a/model", "--model", "b/model"])
    assert exit_info.value.code == 2
    assert "\nerror: two different models" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--max-token", "10"],
        ["chat", "--temp", "0"],
        ["serve", "--max-model", "64"],
        ["bench", "latency", "--batch", "2"],
        ["bench", "serve", "--num-prompt", "2"],
        ["models", "--cache", "/tmp"],
    ],
)
def test_no_flag_is_taken_abbreviated(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """`--max-token 10` was silently `--max-tokens 10`: a prefix of a flag is no flag."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: vllm-mamba {argv[0]}"), err
    assert f"\nerror: unrecognized arguments: {argv[-2]}" in err, err


def test_serve_startup_errors_are_one_error_line() -> None:
    """`serve` reports a model that is not there as every subcommand does (it logged
    `ERROR <date> [module] ...`): `error: ...` on stderr, exit status 2."""
    done = _cli("serve", "./no/such/model", "--port", "0")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == "error: model directory './no/such/model' does not exist"
    assert "ERROR" not in done.stderr and "Traceback" not in done.stderr


MODEL_WORDS = ["./models/mamba-130m", "../m", "/abs/m", "~/m", "models/", "owner/name"]
MODEL_WORDS += ["vllm-mamba/tiny-stdlib", "models/mamba/130m", "."]
PROMPT_WORDS = ["hello", "def f(x):", "import os.path", "#!/bin/sh", "/** doc */", "// note"]
PROMPT_WORDS += ["a / b", "~x", "print(1/2)", "x = 1\ny/z/w", "# see a/b"]


def test_which_first_words_name_a_model() -> None:
    """A word shaped as a path or a model name is the model (and an error when it is not
    there), never a prompt; source code stays a prompt."""
    assert [w for w in MODEL_WORDS if not names_a_model(w)] == []
    assert [w for w in PROMPT_WORDS if names_a_model(w)] == []


def test_generate_refuses_a_model_path_that_is_not_there(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`generate ./models/mamba-130m "hello"` exited 0 after generating from the shipped model
    on two prompts, the path and `hello`."""
    assert main(["generate", "./models/mamba-130m", "hello", "--max-tokens", "2"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: model directory './models/mamba-130m' does not exist (")
    assert "give the model with --model" in err and err.count("\n") == 1
    assert out == ""
    assert main(["generate", "models/mamba-130m/", "--max-tokens", "2"]) == 2
    assert "'models/mamba-130m/' does not exist" in capsys.readouterr().err


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
    args = gen.parse_args(["generate", *PROMPT_WORDS])  # source code stays prompts
    assert resolve_prompts(args) == PROMPT_WORDS and args.model == DEFAULT_MODEL
    args = gen.parse_args(["generate", "--model", DEFAULT_MODEL, "a/b"])  # a prompt after all
    assert resolve_prompts(args) == ["a/b"]


def test_a_log_record_ends_an_open_line_of_its_own_terminal_only() -> None:
    terminal, log_file = io.StringIO(), io.StringIO()
    log = logging.getLogger("vllm_mamba.tests.streamed_text")
    handlers = [LineHandler(terminal), LineHandler(log_file)]
    for handler in handlers:
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        log.addHandler(handler)
    try:
        with StreamedText(terminal) as text:
            text.write("import os.path.join(self._path")
            log.warning("CPU threads 2 -> 1")
            text.write(")\n")
            log.warning("between lines")  # no line open: no blank line
    finally:
        for handler in handlers:
            log.removeHandler(handler)
    assert terminal.getvalue() == (
        "import os.path.join(self._path\nWARNING CPU threads 2 -> 1\n)\nWARNING between lines\n"
    )
    assert log_file.getvalue() == "WARNING CPU threads 2 -> 1\nWARNING between lines\n"


def _generate(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`vllm-mamba generate ARGV` in this process: its exit status, stdout and stderr."""
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_reads_standard_input(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["vllm-mamba/tiny-stdlib", "--max-tokens", "8", "--max-num-seqs", "2"]
    outs = []
    for dash in ([], ["-"]):  # piped, with or without `-`
        monkeypatch.setattr(sys, "stdin", io.StringIO("class Foo:\n    def bar(self):\n"))
        code, out, err = _generate([*common, *dash], capsys)
        assert code == 0, err
        assert "--- 'class Foo:\\n    def bar(self):'\n" in out  # all of it, one prompt
        assert out.splitlines()[-1].startswith("1 prompt(s), 8 tokens")
        outs.append(out.split("\n\n")[0])
    assert outs[0] == outs[1]  # the same output


def test_generate_system_needs_a_chat_template(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.tiny_models import tiny_model_dir

    common = ["--max-tokens", "4", "--max-num-seqs", "2", "--system", "Helpers."]
    code, _, err = _generate(["--model", tiny_model_dir("tied"), "def f():", *common], capsys)
    assert code == 2 and err.splitlines()[-1].startswith("error: --system needs a chat template")
    code, out, err = _generate([DEFAULT_MODEL, "def f():", *common, "--stop", "\n"], capsys)
    assert code == 0, err
    assert "--- 'def f():'\n" in out


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
