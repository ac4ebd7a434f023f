"""A server with `--enable-prefix-caching`: lm-eval-style multiple choice (one context, several
continuations, echoed logprobs) equals transformers while the cache serves the shared context;
`usage.prompt_tokens_details.cached_tokens` and the `vllm:prefix_cache_*` counters report it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.conftest import MODEL_NAME, RunningServer, launch_server
from tests.helpers.runners import HfRunner

ATOL = 3e-4  # float32 on both sides through different kernels (see test_echo_logprobs)
CONTEXT, CHOICE, CHOICES = 40, 5, 4


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with launch_server("--enable-prefix-caching", "--max-num-batched-tokens", "32") as running:
        yield running


def post(server: RunningServer, path: str, body: dict) -> dict:
    resp = httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def metric(server: RunningServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=30).text
    match = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_multiple_choice_hits_and_equals_transformers(
    server: RunningServer, hf_runner: type[HfRunner]
) -> None:
    hf = hf_runner(server.model_dir)
    rng = random.Random(0)
    queries = metric(server, "vllm:prefix_cache_queries_total")
    for _ in range(2):
        context = [rng.randrange(100, 50000) for _ in range(CONTEXT)]
        prompts = [context + [rng.randrange(100, 50000) for _ in range(CHOICE)] for _ in range(4)]
        body = dict(
            model=MODEL_NAME, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0
        )
        out = post(server, "/v1/completions", body)
        # Every continuation after the first starts from the shared context's snapshot.
        cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (CHOICES - 1) * CONTEXT
        for prompt, choice in zip(prompts, sorted(out["choices"], key=lambda c: c["index"])):
            lps = choice["logprobs"]["token_logprobs"]
            ref = hf.logprobs(prompt)
            assert lps[0] is None and len(lps) == len(prompt) + 1
            for i in range(1, len(prompt)):
                assert lps[i] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=ATOL)
    hits = metric(server, "vllm:prefix_cache_hits_total")
    assert hits >= 2 * (CHOICES - 1) * CONTEXT
    assert metric(server, "vllm:prefix_cache_queries_total") - queries >= 2 * CHOICES * CONTEXT


def test_chat_follow_up_turn_is_cached(server: RunningServer) -> None:
    messages = [{"role": "user", "content": "Tell me a story about a fox and a crow " * 3}]
    body = dict(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0)
    first = post(server, "/v1/chat/completions", body)
    answer = first["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
    second = post(server, "/v1/chat/completions", dict(body, messages=messages))
    details = second["usage"]["prompt_tokens_details"]
    # The follow-up's prompt starts with the first prompt: at least that much is cached.
    assert details["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
    assert details["cached_tokens"] < second["usage"]["prompt_tokens"]
