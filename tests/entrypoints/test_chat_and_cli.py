"""Chat everywhere (`LLM.chat`, the server, the `chat` REPL), a model without a chat template,
`generation_config.json` defaults, `vllm-mamba models`, `generate --stream --n`, and the logs
of `generate` and `chat` (warnings only by default, never inside the streamed text)."""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.conftest import RunningServer, launch_server
from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams
from vllm_mamba.entrypoints.chat_cli import ChatSession
from vllm_mamba.entrypoints.chat_utils import ChatTemplate
from vllm_mamba.entrypoints.cli import main
from vllm_mamba.logger import LineHandler
from vllm_mamba.model_zoo import DEFAULT_MODEL

MESSAGES = [
    {"role": "system", "content": "String helpers."},
    {"role": "user", "content": "def reverse(text):"},
]
GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def shipped() -> LLM:
    return LLM(DEFAULT_MODEL, max_num_seqs=4)


@pytest.fixture(scope="module")
def shipped_server() -> Iterator[RunningServer]:
    """The shipped model with its own chat template (the conftest's default is replaced)."""
    with launch_server("--chat-template", "", model_dir=DEFAULT_MODEL) as running:
        yield running


def test_llm_chat_equals_the_server(shipped: LLM, shipped_server: RunningServer) -> None:
    want = shipped.chat(MESSAGES, GREEDY, use_tqdm=False)[0]
    assert want.prompt == "# String helpers.\ndef reverse(text):"
    body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0}
    url = f"{shipped_server.url}/v1/chat/completions"
    got = httpx.post(url, json=body, headers=shipped_server.headers, timeout=60).json()
    assert got["choices"][0]["message"]["content"] == want.outputs[0].text
    assert got["usage"]["prompt_tokens"] == len(want.prompt_token_ids)


def test_llm_chat_batches_conversations(shipped: LLM) -> None:
    other = [{"role": "user", "content": "import os"}]
    both = shipped.chat([MESSAGES, other], GREEDY, use_tqdm=False)
    alone = [shipped.chat(c, GREEDY, use_tqdm=False)[0] for c in (MESSAGES, other)]
    assert [o.outputs[0].text for o in both] == [o.outputs[0].text for o in alone]


def test_no_chat_template_is_a_clear_error() -> None:
    model = tiny_model_dir("tied")  # its tokenizer has no chat template
    with pytest.raises(ValueError, match="--chat-template"):
        LLM(model, max_num_seqs=2).chat(MESSAGES, GREEDY, use_tqdm=False)
    with launch_server("--chat-template", "", model_dir=model) as server:
        url = f"{server.url}/v1/chat/completions"
        response = httpx.post(url, json={"messages": MESSAGES}, headers=server.headers)
        assert response.status_code == 400
        assert "--chat-template" in response.json()["error"]["message"]
        info = httpx.get(f"{server.url}/tokenizer_info").json()
        assert info["chat_template"] is None


def test_chat_repl_keeps_history_and_resets(shipped: LLM) -> None:
    template = ChatTemplate(shipped.get_tokenizer())
    session = ChatSession(shipped, template, GREEDY, "String helpers.")
    out = io.StringIO()
    session.loop(io.StringIO("def reverse(text):\nimport os\n/reset\n/exit\n"), out)
    first = shipped.chat(MESSAGES, GREEDY, use_tqdm=False)[0].outputs[0].text
    history = [*MESSAGES, {"role": "assistant", "content": first}]
    second = shipped.chat([*history, {"role": "user", "content": "import os"}], GREEDY)
    text = out.getvalue()
    assert first in text and second[0].outputs[0].text in text  # the second turn saw the first
    assert "(history cleared)" in text
    assert session.history == [{"role": "system", "content": "String helpers."}]


@pytest.fixture(scope="module")
def greedy_config_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with a generation_config.json asking for greedy, 5-token outputs."""
    path = str(tmp_path_factory.mktemp("gen-config") / "model")
    shutil.copytree(tiny_model_dir("tied"), path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.0, "max_new_tokens": 5, "top_k": 0, "eos_token_id": 0}, f)
    return path


def test_generation_config_defaults(greedy_config_model: str) -> None:
    llm = LLM(greedy_config_model, max_num_seqs=2)
    assert llm.get_default_sampling_params().temperature == 0.0
    outs = [llm.generate([[3, 4, 5]], use_tqdm=False)[0].outputs[0] for _ in range(2)]
    assert len(outs[0].token_ids) == 5 and outs[0].token_ids == outs[1].token_ids
    plain = LLM(greedy_config_model, max_num_seqs=2, generation_config="vllm")
    assert plain.get_default_sampling_params().max_tokens == SamplingParams().max_tokens
    with launch_server("--chat-template", "", model_dir=greedy_config_model) as server:
        url = f"{server.url}/v1/completions"
        body = {"prompt": [3, 4, 5]}
        got = httpx.post(url, json=body, headers=server.headers, timeout=60).json()
        assert got["usage"]["completion_tokens"] == 5
        assert got["choices"][0]["text"] == outs[0].text
        body["max_tokens"] = 2  # what the request sets wins
        got = httpx.post(url, json=body, headers=server.headers, timeout=60).json()
        assert got["usage"]["completion_tokens"] == 2


def test_models_command_lists_shipped_and_cached(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = tmp_path / "models--someone--tiny-mamba" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    shutil.copy(os.path.join(tiny_model_dir("tied"), "config.json"), snapshot / "config.json")
    (tmp_path / "models--someone--tiny-mamba" / "refs").mkdir()
    (tmp_path / "models--someone--tiny-mamba" / "refs" / "main").write_text("abc123")
    assert main(["models", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert DEFAULT_MODEL in out
    assert "someone/tiny-mamba  (MambaForCausalLM)" in out


def test_generate_stream_prints_every_continuation(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "def add(a, b):", "--stream", "--n", "2", "--temperature", "1.0"]
    assert main([*argv, "--max-tokens", "6", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "--- 'def add(a, b):' [0]" in out and "--- 'def add(a, b):' [1]" in out
    assert "1 prompt(s), 12 tokens" in out


def _on_one_terminal(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Runs `vllm-mamba ARGV` in this process with standard output and the log on one
    terminal, while the engine's third step logs an info line (as the thread governor's `CPU
    threads 2 -> 1`) and a warning, in the middle of the streamed text; returns the
    terminal's lines."""
    from vllm_mamba.engine.llm_engine import LLMEngine

    step = LLMEngine.step
    calls = itertools.count()
    log = logging.getLogger("vllm_mamba.engine.cpu_threads")

    def noisy_step(self: LLMEngine) -> list:
        if next(calls) == 2:
            log.info("CPU threads 2 -> 1")
            log.warning("a warning")
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", noisy_step)
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stdout", terminal)
    handler = LineHandler(terminal)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    project = logging.getLogger("vllm_mamba")
    project.addHandler(handler)
    try:
        assert main(argv) == 0
    finally:
        project.removeHandler(handler)
    lines = terminal.getvalue().splitlines()
    assert "WARNING a warning" in lines
    logs = [line for line in lines if line.startswith(("INFO ", "WARNING "))]
    text = [line for line in lines if line not in logs]
    assert not [line for line in text if "INFO " in line or "WARNING " in line]  # never inside
    return lines


@pytest.mark.parametrize("verbose", [False, True])
def test_generate_logs_warnings_only_and_never_inside_the_text(
    verbose: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log line landed inside the streamed text (`import os.path.join(self._pathINFO ...`):
    `generate` logs warnings and up (info with `-v`), and a record on the same terminal as
    the text starts on its own line."""
    argv = ["generate", "def add(a, b):", "--stream", "--max-tokens", "8", "--seed", "0"]
    lines = _on_one_terminal([*argv, *(["-v"] if verbose else [])], monkeypatch)
    assert ("INFO CPU threads 2 -> 1" in lines) is verbose
    at = lines.index("WARNING a warning")
    assert lines[at - 1].startswith(("def add(a, b):", "INFO CPU threads"))  # the text ended
    assert lines[-1].startswith("1 prompt(s), 8 tokens")


def test_chat_logs_warnings_only_and_never_inside_the_reply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`chat` reads standard input, and logs as `generate` does."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("def reverse(text):\n"))
    argv = ["chat", "--max-tokens", "12", "--temperature", "0", "--max-num-seqs", "2"]
    lines = _on_one_terminal(argv, monkeypatch)
    assert "\n".join(lines).count("> ") == 2  # one reply, then the end of input leaves
    assert not [line for line in lines if line.startswith("INFO ")]
    at = lines.index("WARNING a warning")
    assert lines[at - 1].startswith("> ")  # the reply's first line, after the prompt, ended
