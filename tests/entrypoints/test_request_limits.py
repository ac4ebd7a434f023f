"""Request limits and grammar compiles against a real server: a grammar that compiles for
seconds holds up no other request (it compiles in its own process) and is a 400 naming its
field once over `--grammar-compile-timeout`; every list- or text-valued field over its limit is
a 400 naming it; malformed tool `$defs` are 400s, not 500s; `prompt_logprobs` is answered, and
above the limit a 400; error messages carry no source paths or reprs.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.entrypoints.conftest import RunningServer, launch_server
from vllm_mamba import request_limits as limits

COMPLETION = {"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
COMPILE_TIMEOUT_S = 1.5


def slow_grammar(rules: int = 1500) -> str:
    """An EBNF grammar of nested rules that compiles for seconds (superlinear in `rules`)."""
    body = "\n".join(f'r{i} ::= "a{i}" | r{i + 1}' for i in range(rules))
    return f'root ::= r0\n{body}\nr{rules} ::= "z"'


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with launch_server("--grammar-compile-timeout", str(COMPILE_TIMEOUT_S)) as running:
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
    response = post(server, "/v1/completions", {**COMPLETION, "prompt_logprobs": 10**9})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt_logprobs"
    response = post(server, "/v1/completions", {**COMPLETION, "prompt_logprobs": 2})
    assert response.status_code == 200, response.text
    entries = response.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) > 1
    assert all(1 <= len(e) <= 3 for e in entries[1:])
    chat = post(server, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 1})
    assert chat.status_code == 200 and chat.json()["prompt_logprobs"][0] is None
    streamed = post(server, "/v1/completions", {**COMPLETION, "prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400
