"""Request limits and grammar compiles against a real server: a grammar that compiles for
seconds holds up no other request (it compiles in its own process) and is a 400 naming its
field once over `--grammar-compile-timeout`; every list- or text-valued field over its limit is
a 400 naming it; malformed tool `$defs` are 400s, not 500s; `prompt_logprobs` is answered, and
out of range (-1 too) a 400; error messages carry no source paths or reprs; a 500 (a tool-call
parser plugin with a bug) says `Connection: close`; model text that cannot be a call (too
deep, a huge integer, an escaped lone surrogate) is content, not a 500 or a cut stream.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, RunningServer, launch_server
from tests.tiny_models import TOKENIZER_DIR
from vllm_mamba import request_limits as limits

COMPLETION = {"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
COMPILE_TIMEOUT_S = 1.5


def slow_grammar(rules: int = 1500) -> str:
    """An EBNF grammar of nested rules that compiles for seconds (superlinear in `rules`)."""
    body = "\n".join(f'r{i} ::= "a{i}" | r{i + 1}' for i in range(rules))
    return f'root ::= r0\n{body}\nr{rules} ::= "z"'


# hermes with a bug: a request offering a tool named `crash` fails inside the parser (a 500).
HERMES_WITH_A_BUG = """
from vllm_mamba.entrypoints.openai.tool_parsers import ToolParserManager
from vllm_mamba.entrypoints.openai.tool_parsers.hermes import HermesToolParser


@ToolParserManager.register("hermes_with_a_bug")
class HermesWithABug(HermesToolParser):
    def extract(self, text, strict=False):
        if "crash" in str(self.tools):
            raise RuntimeError("a bug in the tool-call parser")
        return super().extract(text, strict)

    def stream(self):
        if "crash" in str(self.tools):
            raise RuntimeError("a bug in the tool-call parser")
        return super().stream()
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    plugin = tmp_path_factory.mktemp("plugin") / "hermes_with_a_bug.py"
    plugin.write_text(HERMES_WITH_A_BUG)
    with launch_server(
        "--grammar-compile-timeout",
        str(COMPILE_TIMEOUT_S),
        "--tool-parser-plugin",
        str(plugin),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes_with_a_bug",
    ) as running:
        yield running


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=120)


def probe(server: RunningServer) -> float:
    start = time.perf_counter()
    assert post(server, "/v1/completions", COMPLETION).status_code == 200
    return time.perf_counter() - start


@pytest.mark.whole_machine  # a latency ratio
def test_slow_grammar_is_a_400_and_stalls_no_one(server: RunningServer) -> None:
    idle = statistics.median(probe(server) for _ in range(5))
    result: dict[str, httpx.Response] = {}
    body = {**COMPLETION, "structured_outputs": {"grammar": slow_grammar()}}
    attack = threading.Thread(target=lambda: result.update(r=post(server, "/v1/completions", body)))
    attack.start()
    time.sleep(0.2)
    during = []
    while attack.is_alive() and len(during) < 20:
        during.append(probe(server))
    attack.join()
    response = result["r"]
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "structured_outputs"
    assert "took more than" in error["message"]
    assert during and max(during) < 10 * idle + 0.5, (idle, during)
    again = {**COMPLETION, "structured_outputs": {"choice": ["yes", "no"]}}
    assert post(server, "/v1/completions", again).status_code == 200  # a fresh worker


def _big(field: str) -> Any:
    over = {
        "stop": ["x"] * (limits.MAX_STOP + 1),
        "bad_words": ["word"] * (limits.MAX_BAD_WORDS + 1),
        "logit_bias": {str(i): 1.0 for i in range(limits.MAX_LOGIT_BIAS_ENTRIES + 1)},
        "stop_token_ids": [1] * (limits.MAX_STOP_TOKEN_IDS + 1),
        "guided_choice": [f"c{i}" for i in range(limits.MAX_CHOICES + 1)],
        "guided_regex": "a" * (limits.MAX_GRAMMAR_BYTES + 1),
        "guided_json": {"enum": ["v" * 10] * (limits.MAX_GRAMMAR_BYTES // 10)},
    }
    return over[field]


@pytest.mark.parametrize(
    "field",
    [
        "stop",
        "bad_words",
        "logit_bias",
        "stop_token_ids",
        "guided_choice",
        "guided_regex",
        "guided_json",
    ],
)
def test_fields_over_their_limit_are_400s(server: RunningServer, field: str) -> None:
    response = post(server, "/v1/completions", {**COMPLETION, field: _big(field)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field, error
    assert "limit" in error["message"]


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_too_many_tools_is_a_400(server: RunningServer) -> None:
    tools = [_tool(f"f{i}", {"type": "object"}) for i in range(limits.MAX_TOOLS + 1)]
    response = post(
        server, "/v1/chat/completions", {**CHAT, "tools": tools, "tool_choice": "required"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_defs_of_the_wrong_type_are_400s(server: RunningServer, choice: Any) -> None:
    tools = [_tool("f", {"type": "object", "$defs": [1, 2]})]
    response = post(server, "/v1/chat/completions", {**CHAT, "tools": tools, "tool_choice": choice})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools"
    assert "TypeError" not in error["message"] and "Traceback" not in error["message"]


def test_conflicting_defs_across_tools_are_a_400(server: RunningServer) -> None:
    def tool(name: str, kind: str) -> dict[str, Any]:
        params = {
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/Item"}},
            "required": ["x"],
            "$defs": {"Item": {"type": kind}},
        }
        return _tool(name, params)

    body = {**CHAT, "tools": [tool("a", "string"), tool("b", "integer")], "tool_choice": "required"}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools"
    assert "Item" in response.json()["error"]["message"]
    same = {**body, "tools": [tool("a", "string"), tool("b", "string")]}
    # Equal definitions are accepted (four tokens then cut the call short: a 400 that says so).
    accepted = post(server, "/v1/chat/completions", same)
    assert accepted.status_code == 200 or "max_tokens" in accepted.json()["error"]["message"]


def test_xgrammar_errors_carry_no_source_path(server: RunningServer) -> None:
    deep = "[" * 20000 + "]" * 20000
    for body in (
        {**COMPLETION, "guided_json": {"type": "array", "items": {"$ref": "#/$defs/missing"}}},
        {**COMPLETION, "guided_regex": "(" * 5000},
        {**COMPLETION, "guided_grammar": "root ::= " + deep[:1000]},
    ):
        response = post(server, "/v1/completions", body)
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "/project" not in message and ".cc" not in message and ".h:" not in message


def test_prompt_logprobs_are_answered_and_bounded(server: RunningServer) -> None:
    """Out of [0, 20] is a 400, -1 too (as `logprobs: -1` is here: vLLM's "the whole
    vocabulary" is not served), with or without echo's own prompt logprobs."""
    for body in (
        {"prompt_logprobs": 10**9},
        {"prompt_logprobs": -1},
        {"prompt_logprobs": -1, "echo": True, "logprobs": 1},
        {"logprobs": -1},
    ):
        response = post(server, "/v1/completions", {**COMPLETION, **body})
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == next(iter(body)), body
    chat = post(server, "/v1/chat/completions", {**CHAT, "prompt_logprobs": -1})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "prompt_logprobs"
    response = post(server, "/v1/completions", {**COMPLETION, "prompt_logprobs": 2})
    assert response.status_code == 200, response.text
    entries = response.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) > 1
    assert all(1 <= len(e) <= 3 for e in entries[1:])
    chat = post(server, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 1})
    assert chat.status_code == 200 and chat.json()["prompt_logprobs"][0] is None
    streamed = post(server, "/v1/completions", {**COMPLETION, "prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400


def test_a_500_closes_its_connection_and_says_so(server: RunningServer) -> None:
    """An internal error's 500 says `Connection: close`, and the connection is closed: a
    keep-alive client opens a new one for its next request instead of failing on it."""
    host, port = server.url.removeprefix("http://").split(":")
    tools = [{"type": "function", "function": {"name": "crash", "parameters": {}}}]
    body = json.dumps({**CHAT, "tools": tools}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"authorization: {server.headers['Authorization']}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head.encode() + body)
        received = b""
        while chunk := sock.recv(65536):  # ends only when the server closes
            received += chunk
    status, _, rest = received.partition(b"\r\n")
    headers = rest.partition(b"\r\n\r\n")[0].lower().split(b"\r\n")
    assert status.startswith(b"HTTP/1.1 500"), received
    assert b"connection: close" in headers, received
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    with httpx.Client(headers=server.headers, timeout=60) as client:
        failed = client.post(f"{server.url}/v1/chat/completions", json={**CHAT, "tools": tools})
        assert failed.status_code == 500 and failed.headers["connection"] == "close"
        assert client.post(f"{server.url}/v1/chat/completions", json=CHAT).status_code == 200


def test_a_bug_in_a_stream_ends_it_with_an_error_event(server: RunningServer) -> None:
    """The same bug while streaming (chat; completions and responses share the guard): the
    stream ends with an error event in OpenAI's shape and `[DONE]`, not cut off."""
    tools = [{"type": "function", "function": {"name": "crash", "parameters": {}}}]
    body = {**CHAT, "tools": tools, "stream": True, "model": MODEL_NAME}
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=60
    ) as response:
        assert response.status_code == 200
        events = [line[len("data: ") :] for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "RuntimeError" in error["message"], events


# Model text that looks like hermes calls but cannot give JSON arguments: an escaped lone
# surrogate (not Unicode: was a 400 blaming the client), an integer past Python's digit limit
# (ValueError: a 400, or a cut stream) and nesting past the parsers' bound (RecursionError in
# json: a 500, or a cut stream), the last region left open. All of it is content.
_CALL = '<tool_call>{"name": "get_weather", "arguments": '
NOT_CALLS = (
    _CALL
    + '{"city": "\\udbff"}}</tool_call>\n'
    + _CALL
    + '{"days": 1'
    + "0" * 4416
    + "}}</tool_call>\n"
    + _CALL
    + "[" * 1000
)


def forced_in_runs(text: str, runs: list[str]) -> dict[str, Any]:
    """Extra fields that make the model write exactly `text` (`structured_outputs.choice`),
    a repeated character `run[0]` only as `run` (one token) at a time: a random model left to
    itself spells `[[[[` one bracket a token."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    run_ids = [tokenizer.encode(run) for run in runs]
    assert all(len(ids) == 1 for ids in run_ids)
    singles = {i for c in set(text) - {r[0] for r in runs} for i in tokenizer.encode(c)}
    allowed = singles | {ids[0] for ids in run_ids} | {0}  # 0: the end of text
    return {"structured_outputs": {"choice": [text]}, "allowed_token_ids": sorted(allowed)}


def test_text_that_cannot_be_a_call_is_content(server: RunningServer) -> None:
    """Streamed (`extract`, the non-streamed path, runs the same stream over the whole text):
    the stream carries all the text as content, no call, and ends normally."""
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    chunks = api.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT["messages"],
        tools=[tool],
        max_tokens=3000,
        temperature=0,
        stream=True,
        extra_body=forced_in_runs(NOT_CALLS, ["[[", "0" * 32]),
    )
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert not any(d.delta.tool_calls for d in deltas)
    assert "".join(d.delta.content or "" for d in deltas) == NOT_CALLS
    assert deltas[-1].finish_reason == "stop"
