"""Regression tests for the adversarial-client findings, against a real server process: values
that used to kill the engine are 400s, lone surrogates are 400s, `max_completion_tokens: 0` is
a 400, bodies over the limit are 413s, request chat templates are refused unless trusted and
then bounded in time, the auth scheme matches in any case with the first header winning, and
a second server on a busy port fails at once without loading the model.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, RunningServer, launch_server

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "hello", "max_tokens": 4}
LOOPING_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """A server with a small body limit that trusts request chat templates."""
    with launch_server("--max-request-bytes", "200000", "--trust-request-chat-template") as s:
        yield s


def post(server: RunningServer, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    """POSTs `body` as JSON text (lone surrogates escaped, NaN allowed)."""
    headers = {**server.headers, "content-type": "application/json", **kwargs.pop("headers", {})}
    content = body if isinstance(body, (str, bytes, Iterator)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60, **kwargs)


def assert_healthy(server: RunningServer) -> None:
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    ok = post(server, "/v1/completions", {**COMPLETION, "temperature": 0})
    assert ok.status_code == 200, ok.text


ENGINE_KILLERS = [
    ("/v1/completions", {**COMPLETION, "seed": 2**64}, "seed"),
    ("/v1/completions", {**COMPLETION, "seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {**COMPLETION, "seed": 2**64 - 1, "n": 2}, "seed"),
    ("/v1/chat/completions", {**CHAT, "seed": 10**30, "stream": True}, "seed"),
    ("/v1/completions", {**COMPLETION, "top_k": 2**63, "temperature": 1.0}, "top_k"),
    ("/v1/chat/completions", {**CHAT, "top_k": 10**30}, "top_k"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [99999], "min_tokens": 1}, None),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [-5000], "min_tokens": 1}, None),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [2**64], "min_tokens": 1}, None),
]


@pytest.mark.parametrize(("path", "body", "param"), ENGINE_KILLERS)
def test_values_that_killed_the_engine_are_400s(
    server: RunningServer, path: str, body: dict[str, Any], param: str | None
) -> None:
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == (param or "stop_token_ids")
    assert_healthy(server)


RESPONSE = {"input": "hi", "max_output_tokens": 4}


def generated_tokens(server: RunningServer) -> float:
    """The server's `vllm:generation_tokens` counter."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    [line] = [x for x in text.splitlines() if x.startswith("vllm:generation_tokens_total")]
    return float(line.split()[-1])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**COMPLETION, "prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {**COMPLETION, "bad_words": ["ok", "\ud800"]}, "bad_words.1"),
        ("/v1/completions", {**COMPLETION, "stop": "\udfff"}, "stop"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]},
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "us\udc00er", "content": "x"}]},
            "messages.0.role",
        ),
        ("/v1/chat/completions", {**CHAT, "chat_template": "{{ '\ud800' }}"}, "chat_template"),
        ("/v1/chat/completions", {**CHAT, "bad_words": ["\ud800"]}, "bad_words.0"),
        ("/v1/responses", {**RESPONSE, "metadata": {"k": "\ud800"}}, "metadata.k"),
        ("/v1/responses", {**RESPONSE, "user": "u\ud800"}, "user"),
        ("/v1/responses", {**RESPONSE, "instructions": "\udc00"}, "instructions"),
        (
            "/v1/responses",
            {**RESPONSE, "input": [{"role": "user", "content": "\ud800"}]},
            "input.0.content",
        ),
        ("/tokenize", {"prompt": "x\ud800"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ],
)
def test_lone_surrogates_are_400s(server: RunningServer, path: str, body: Any, param: str) -> None:
    """Refused at the door, naming the field, before the model runs (`bad_words` was a 500;
    a Responses request whose `metadata` or `user` held one ran, was stored, then failed)."""
    before = generated_tokens(server)
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "not valid Unicode" in error["message"]
    assert error["param"] == param
    assert generated_tokens(server) == before


METADATA_OVER_THE_BOUNDS = {
    "17 keys": {f"k{i}": "v" for i in range(17)},
    "65-char key": {"k" * 65: "v"},
    "513-char value": {"k": "v" * 513},
    "nested value": {"k": {"a": [{"b": "c"}]}},
    "number value": {"k": 1},
}


@pytest.mark.parametrize(
    "metadata", METADATA_OVER_THE_BOUNDS.values(), ids=list(METADATA_OVER_THE_BOUNDS)
)
def test_responses_metadata_over_openai_bounds_is_a_400(
    server: RunningServer, metadata: dict[str, Any]
) -> None:
    """OpenAI's bounds (16 keys, 64-character keys, 512-character string values), checked
    before the model runs; at the bounds it is kept and echoed."""
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    before = generated_tokens(server)
    with pytest.raises(openai.BadRequestError) as err:
        api.responses.create(model=MODEL_NAME, metadata=metadata, **RESPONSE)
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "metadata"
    assert generated_tokens(server) == before
    if len(metadata) > 1:  # once: the largest metadata within the bounds
        largest = {f"{i:02}" + "k" * 62: "v" * 512 for i in range(16)}
        reply = api.responses.create(model=MODEL_NAME, metadata=largest, **RESPONSE)
        assert reply.metadata == largest
        assert api.responses.retrieve(reply.id).metadata == largest


def test_response_store_counts_the_memory_it_holds() -> None:
    """What the Responses store counts against its byte bound is the memory it holds
    (measured with tracemalloc), for responses with the largest `metadata` allowed and a
    conversation of many small items (counted as JSON text beside parsed objects, it held
    about 18 times its count)."""
    from vllm_mamba.entrypoints.openai.responses_protocol import ResponsesRequest
    from vllm_mamba.entrypoints.openai.serving_responses import ResponseStore

    metadata = {f"{i:02}" + "k" * 62: "v" * 512 for i in range(16)}
    items = [{"role": "user", "content": f"{i}"} for i in range(100)]
    request = ResponsesRequest(input=items, metadata=metadata)
    tracemalloc.start()
    try:
        store = ResponseStore(max_items=10_000, max_bytes=2**18)
        base = tracemalloc.get_traced_memory()[0]
        for i in range(40):  # past the bound: the oldest go
            body = {"id": f"resp_{i:032}", "metadata": request.metadata, "input": items}
            conversation = json.dumps(items).encode()
            store.put(body["id"], conversation, json.dumps(body).encode())
        del body, conversation
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert store.max_bytes / 2 <= store.bytes <= store.max_bytes
    assert held <= store.bytes * 1.1, (held, store.bytes)


def test_max_completion_tokens_zero_is_a_400(server: RunningServer) -> None:
    response = post(server, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 0})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    one = post(server, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 1})
    assert one.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p"])
def test_nan_and_infinity_are_400s(server: RunningServer, field: str) -> None:
    for value in ("NaN", "Infinity"):
        body = json.dumps(COMPLETION)[:-1] + f', "{field}": {value}}}'
        response = post(server, "/v1/completions", body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field


def test_body_over_the_limit_is_a_413(server: RunningServer) -> None:
    big = json.dumps({"prompt": "a" * 300_000, "max_tokens": 1})
    assert post(server, "/v1/completions", big).status_code == 413

    def chunks() -> Iterator[bytes]:  # no content-length: counted as it streams
        for i in range(0, len(big), 10_000):
            yield big[i : i + 10_000].encode()

    response = post(server, "/tokenize", chunks())
    assert response.status_code == 413
    assert response.json()["error"]["code"] == 413
    assert_healthy(server)


def test_unknown_output_changing_fields_are_400s(server: RunningServer) -> None:
    for field, value in [
        ("functions", [{"name": "f"}]),
        ("use_beam_search", True),
        ("logits_processors", ["x"]),
        ("truncate_prompt_tokens", 5),
    ]:
        response = post(server, "/v1/chat/completions", {**CHAT, field: value})
        assert response.status_code == 400, field
        assert response.json()["error"]["param"] == field
    tools = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}
    response = post(server, "/v1/chat/completions", {**CHAT, **tools})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **tools})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
    plain = post(server, "/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}})
    assert plain.status_code == 200


@pytest.mark.whole_machine  # wall-clock bounds
def test_request_chat_template_is_bounded_in_time(server: RunningServer) -> None:
    result: dict[str, httpx.Response] = {}
    body = {**CHAT, "chat_template": LOOPING_TEMPLATE}
    worker = threading.Thread(target=lambda: result.update(r=post(server, "/tokenize", body)))
    start = time.monotonic()
    worker.start()
    time.sleep(0.3)
    health_start = time.monotonic()
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert time.monotonic() - health_start < 1.0  # the event loop is not blocked
    worker.join(timeout=30)
    assert result["r"].status_code == 400
    assert "ran for more than" in result["r"].json()["error"]["message"]
    assert time.monotonic() - start < 10
    assert_healthy(server)


SANDBOX_ESCAPES = {
    "folded center": "{{ 'x'|center(300000000) }}",  # 300 MB while compiling, then cached
    "lipsum": "{{ lipsum(n=60000) }}",  # 6.5 s in one call
    "~ doubling": "{% set s = 'xxxxxxxx' %}" + "{% set s = s ~ s %}" * 26 + "{{ s|length }}",
}


@pytest.mark.parametrize("source", SANDBOX_ESCAPES.values(), ids=SANDBOX_ESCAPES.keys())
@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_request_chat_templates_stay_in_the_sandbox(
    server: RunningServer, path: str, source: str
) -> None:
    """Issue 46: each was a slow 400 (or a 537 MB prompt and a 200); now a quick 400."""
    start = time.monotonic()
    response = post(server, path, {**CHAT, "chat_template": source})
    elapsed = time.monotonic() - start
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and "chat template" in error["message"]
    assert elapsed < 3.0  # milliseconds of work; 4.8 s (center) and 6.5 s (lipsum) before


def test_routes_that_render_templates_need_the_key(server: RunningServer) -> None:
    """`/tokenize` with chat messages renders a chat template (a request's own too): with a key
    set it needs the key, as `/v1/*` does (it was open to anyone). Plain text tokenization and
    `/detokenize` stay open, as in vLLM (lm-eval's remote tokenizer calls them without one)."""
    rendering = {**CHAT, "chat_template": "{{ messages[0].content }}"}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{server.url}/tokenize", json=rendering, headers=headers, timeout=30)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert post(server, "/tokenize", rendering).status_code == 200
    for path, body in (("/tokenize", COMPLETION), ("/detokenize", {"tokens": [1, 2]})):
        assert httpx.post(f"{server.url}{path}", json=body, timeout=30).status_code == 200, path
    assert httpx.get(f"{server.url}/tokenizer_info", timeout=30).status_code == 200


def test_request_chat_template_needs_the_flag() -> None:
    with launch_server() as plain:
        body = {**CHAT, "chat_template": "{{ messages }}"}
        response = post(plain, "/v1/chat/completions", body)
        assert response.status_code == 400
        assert "--trust-request-chat-template" in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "chat_template"
        busy = _start_on_busy_port(plain)
    assert busy


def _start_on_busy_port(running: RunningServer) -> bool:
    """A second server on `running`'s port fails within seconds, before loading the model."""
    port = running.url.rsplit(":", 1)[1]
    cmd = [sys.executable, "-m", "vllm_mamba.entrypoints.openai.api_server"]
    cmd += ["--model", running.model_dir, "--port", port]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "cannot listen on" in proc.stderr and "Loaded" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    return time.monotonic() - start < 30


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ([("Authorization", f"bearer {API_KEY}")], 200),
        ([("Authorization", f"BEARER {API_KEY}")], 200),
        ([("Authorization", f"Bearer {API_KEY}"), ("Authorization", "Bearer wrong")], 200),
        ([("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {API_KEY}")], 401),
        ([("Authorization", f"Basic {API_KEY}")], 401),
    ],
)
def test_auth_scheme_any_case_first_header_wins(
    server: RunningServer, headers: list[tuple[str, str]], status: int
) -> None:
    response = httpx.get(f"{server.url}/v1/models", headers=httpx.Headers(headers), timeout=10)
    assert response.status_code == status
