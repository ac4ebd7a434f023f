"""Kimi Linear (KDA + MLA over the latent cache), Ling 3 (safe-gated KDA, gated MLA with RoPE),
GLM-5-Next (KDA and sparse MLA over the tokens its indexer selects, in mHC streams), Qwen4-Exp
(GDN and indexed attention in gated hyper-connections, per-layer n-gram embeddings), LFM2 (short
convs + GQA), LFM3 (short convs, sliding-window and full attention in three KV groups) and ZAYA1
(compressed convolutional attention, conv state beside windowed KV) through the OpenAI server
with the official `openai` client, under KV pressure: concurrent completions and a chat
(streamed and not) give `LLM.generate`'s greedy text, and the KV blocks drain afterwards."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.entrypoints.conftest import (
    API_KEY,
    MODEL_NAME,
    RunningServer,
    greedy_completions,
    launch_server,
)
from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams

BLOCKS = 12
MAX_TOKENS = 10
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "A delta rule with a decay per channel keeps",
]
CHAT = "user: What is a recurrent state?\nassistant:"  # the test servers' role: content template


SERVED = [
    "kimi-linear-moe",
    "ling-moe",
    "glm5-next-moe",
    "qwen4-exp-ple",
    "lfm2-gqa",
    "lfm3-gqa",
    "zaya-gqa",
]


@pytest.fixture(scope="module", params=SERVED)
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    flags = ("--num-gpu-blocks-override", str(BLOCKS), "--block-size", "16")
    with launch_server(*flags, model_dir=tiny_model_dir(request.param)) as running:
        yield running


@pytest.fixture(scope="module")
def expected(server: RunningServer) -> dict[str, str]:
    """`LLM.generate`'s greedy continuations of `PROMPTS` and the chat prompt."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with VllmRunner(server.model_dir) as runner:
        outs = runner.generate([*PROMPTS, CHAT], params)
    texts = {o.prompt: o.outputs[0].text for o in outs}
    assert len(set(texts.values())) == len(texts), texts  # varied, so an equality proves much
    return texts


def test_completions_and_chat_equal_llm_generate(
    server: RunningServer, expected: dict[str, str]
) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    got = greedy_completions(server.url, PROMPTS * 2, MAX_TOKENS)
    assert got == [expected[p] for p in PROMPTS * 2]
    messages = [{"role": "user", "content": "What is a recurrent state?"}]
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert whole.choices[0].message.content == expected[CHAT]
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected[CHAT]
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    usage = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", metrics, re.MULTILINE)
    assert usage and float(usage.group(1)) == 0.0  # drained
