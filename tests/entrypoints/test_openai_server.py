"""The OpenAI-compatible server against the official `openai` client, curl-style raw HTTP,
and `LLM.generate` as the reference for its tokens.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME, RunningServer
from tests.helpers.runners import VllmRunner
from vllm_mamba import SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is", "In 1905, Einstein", "def main():"]
MAX_TOKENS = 8
CHAT_PROMPT = "user: Hi there\nassistant:"  # one user message in the default chat template


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def expected(vllm_runner: type[VllmRunner], server: RunningServer) -> dict[str, str]:
    """`LLM.generate`'s greedy texts of `PROMPTS` and `CHAT_PROMPT`, by prompt."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with vllm_runner(server.model_dir, max_model_len=MAX_MODEL_LEN) as runner:
        outs = runner.generate([*PROMPTS, CHAT_PROMPT], params)
    texts = {o.prompt: o.outputs[0].text for o in outs}
    assert len(set(texts.values())) == len(texts), "the reference generations are not varied"
    return texts


def greedy(client: openai.OpenAI, prompt, max_tokens: int = MAX_TOKENS, **kwargs):  # noqa: ANN001, ANN201
    return client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, **kwargs
    )


def metric(server: RunningServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf"^vllm:{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_batch_matches_llm_generate(client: openai.OpenAI, expected: dict[str, str]) -> None:
    batch = greedy(client, PROMPTS)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [
        expected[p] for p in PROMPTS
    ]
    one = greedy(client, PROMPTS[0])
    assert one.choices[0].text == expected[PROMPTS[0]]
    assert one.choices[0].finish_reason == "length"
    assert one.usage.completion_tokens == MAX_TOKENS


def test_token_id_prompts(
    server: RunningServer, client: openai.OpenAI, expected: dict[str, str]
) -> None:
    from transformers import AutoTokenizer

    ids = [AutoTokenizer.from_pretrained(server.model_dir).encode(p) for p in PROMPTS[:2]]
    assert greedy(client, ids[0]).choices[0].text == expected[PROMPTS[0]]
    batch = greedy(client, ids, echo=True)
    assert [c.text for c in batch.choices] == [p + expected[p] for p in PROMPTS[:2]]
    assert batch.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_n_and_seed(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, n=2, seed=7)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 2 * MAX_TOKENS


def test_logprobs_and_echo(client: openai.OpenAI) -> None:
    out = greedy(client, PROMPTS[0], logprobs=2, echo=True).choices[0]
    lp = out.logprobs
    assert out.text.startswith(PROMPTS[0])
    assert "".join(lp.tokens) == out.text
    num_prompt = len(lp.tokens) - MAX_TOKENS
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    for token, value, top in zip(
        lp.tokens[num_prompt:], lp.token_logprobs[num_prompt:], lp.top_logprobs[num_prompt:]
    ):
        assert top[token] == value  # greedy: the chosen token is the best one
        assert max(top.values()) == value
    assert lp.text_offset == sorted(lp.text_offset)


def test_stop_string(client: openai.OpenAI, expected: dict[str, str]) -> None:
    full = expected[PROMPTS[2]]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    out = greedy(client, PROMPTS[2], stop=[stop]).choices[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop"
    streamed = greedy(client, PROMPTS[2], stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.text


def test_streaming_reassembles(client: openai.OpenAI) -> None:
    whole = greedy(client, PROMPTS[3]).choices[0].text
    chunks = list(greedy(client, PROMPTS[3], stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_default_template(client: openai.OpenAI, expected: dict[str, str]) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    kwargs = dict(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    out = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected[CHAT_PROMPT]
    assert len(choice.logprobs.content) == MAX_TOKENS
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected[CHAT_PROMPT]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_concurrent_streams(server: RunningServer, client: openai.OpenAI) -> None:
    prompts = [f"Request {i}: the number {i * 7} is" for i in range(32)]
    alone = [greedy(client, p, max_tokens=4).choices[0].text for p in prompts]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        stream = greedy(client, prompts[i], stream=True, max_tokens=4)
        results[i] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200  # answers under load
    for t in threads:
        t.join(timeout=120)
    assert [results.get(i) for i in range(32)] == alone
    assert metric(server, "state_slots_used") == 0


def test_disconnect_frees_slot(server: RunningServer) -> None:
    body = {"model": MODEL_NAME, "prompt": "Once", "max_tokens": 3000, "ignore_eos": True}
    before = metric(server, "generation_tokens_total")
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={**body, "stream": True},
        headers=server.headers,
    ) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert metric(server, "state_slots_used") == 1
    deadline = time.monotonic() + 20
    while metric(server, "state_slots_used") != 0:
        assert time.monotonic() < deadline, "the slot of a disconnected client was not freed"
        time.sleep(0.1)
    assert metric(server, "num_requests_running") == 0
    assert metric(server, "generation_tokens_total") - before < 3000


def test_gone_non_streaming_client_frees_slot(server: RunningServer) -> None:
    body = {"model": MODEL_NAME, "prompt": "Once", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=1)
    deadline = time.monotonic() + 20
    while metric(server, "state_slots_used") != 0:
        assert time.monotonic() < deadline, "the slot of a gone client was not freed"
        time.sleep(0.1)


def test_serve_cli_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_mamba.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "some/model", "--port", "9000", "--api-key", "k"])
    assert (args.model, args.port, args.api_key, args.host) == (
        "some/model",
        9000,
        "k",
        "127.0.0.1",
    )
    assert callable(args.func)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--dtype"):
        assert flag in help_text
    assert "(default: 8000)" in help_text and "(default: 256)" in help_text


def test_api_key(server: RunningServer) -> None:
    url = f"{server.url}/v1/models"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = httpx.get(url, headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url, headers=server.headers).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200


GOOD = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
BAD = [
    ("temperature", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("top_p", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("n", {**GOOD, "n": 0}, 400, "n"),
    ("logprobs", {**GOOD, "logprobs": 50}, 400, "logprobs"),
    ("max_tokens", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("no prompt", {"model": MODEL_NAME}, 400, "prompt"),
    ("empty prompt", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("empty batch", {**GOOD, "prompt": []}, 400, "prompt"),
    ("bad token", {**GOOD, "prompt": [10**9]}, 400, "prompt"),
    ("too long", {**GOOD, "prompt": [5] * (MAX_MODEL_LEN + 1)}, 400, "prompt"),
    ("wrong type", {**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
    ("unknown model", {**GOOD, "model": "nope"}, 404, "model"),
    ("malformed", b'{"prompt": ', 400, None),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input(server: RunningServer, name: str, body, status: int, param) -> None:  # noqa: ANN001
    url = f"{server.url}/v1/completions"
    headers = {**server.headers, "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(url, content=content, headers=headers)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert httpx.post(url, json=GOOD, headers=server.headers).status_code == 200


def test_unknown_route_and_chat_errors(server: RunningServer) -> None:
    resp = httpx.get(f"{server.url}/v1/nothing", headers=server.headers)
    assert resp.status_code == 404 and "error" in resp.json()
    chat = f"{server.url}/v1/chat/completions"
    bad = {"model": MODEL_NAME, "messages": [], "max_tokens": 2}
    assert httpx.post(chat, json=bad, headers=server.headers).status_code == 400
    bad = {**bad, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    assert httpx.post(chat, json=bad, headers=server.headers).status_code == 400
    good = {**bad, "logprobs": True}
    assert httpx.post(chat, json=good, headers=server.headers).status_code == 200


# What a page's Content-Security-Policy may allow: nothing from another origin, and no
# script but this origin's files or inline scripts named by their hash.
SAME_ORIGIN_SOURCES = {"'self'", "'none'", "data:"}


def _csp(response: httpx.Response) -> dict[str, list[str]]:
    policy = response.headers.get("content-security-policy")
    assert policy, f"{response.url} has no Content-Security-Policy"
    directives = [part.split() for part in policy.split(";") if part.strip()]
    return {name: sources for name, *sources in directives}


def test_html_pages_load_nothing_from_another_origin(server: RunningServer) -> None:
    for path in ("/", "/docs"):
        page = httpx.get(f"{server.url}{path}")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = _csp(page)
        assert csp["default-src"] == ["'none'"], csp
        for name, sources in csp.items():
            for source in sources:
                allowed = source in SAME_ORIGIN_SOURCES or (
                    name == "script-src" and re.fullmatch(r"'sha256-[A-Za-z0-9+/]+=*'", source)
                )
                allowed = allowed or (name == "style-src" and source == "'unsafe-inline'")
                assert allowed, (path, name, source)
        # What a page loads or links is this origin's (a path, not a URL or `//host`).
        for url in re.findall(r"""\s(?:src|href)=["']([^"']*)["']""", page.text):
            assert url.startswith(("/", "#", "data:")) and not url.startswith("//"), (path, url)
    # The reference's script and style: served here, under the same policy, naming no URL.
    for asset, media in (("docs.js", "text/javascript"), ("docs.css", "text/css")):
        response = httpx.get(f"{server.url}/docs/{asset}")
        assert response.status_code == 200 and response.headers["content-type"].startswith(media)
        assert _csp(response)["script-src"] == ["'self'"]
        assert "http://" not in response.text and "https://" not in response.text
    # FastAPI's own pages, which load Swagger UI or ReDoc from a CDN, are gone.
    for path in ("/redoc", "/docs/oauth2-redirect"):
        assert httpx.get(f"{server.url}{path}").status_code == 404, path
    assert httpx.get(f"{server.url}/openapi.json").json()["paths"]["/v1/completions"]


def test_version_and_metrics(server: RunningServer) -> None:
    assert httpx.get(f"{server.url}/version").json()["version"]
    # one request of its own, so the histograms have observations whatever ran before
    done = httpx.post(f"{server.url}/v1/completions", json=GOOD, headers=server.headers, timeout=60)
    assert done.status_code == 200
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "state_slots_used",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_count",
    ):
        assert f"vllm:{name}" in text
    assert metric(server, "prompt_tokens_total") > 0
