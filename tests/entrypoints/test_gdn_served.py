"""The Gated DeltaNet hybrids through the OpenAI server with the official `openai` client: a
tiny Qwen3.5 served under KV pressure gives `LLM.generate`'s greedy text for concurrent
completions and chats (streamed and not), an image in a chat is a 400 that says the model is
served text-only, and the KV cache and state slots drain afterwards."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, RunningServer, launch_server
from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams

BLOCKS = 12
MAX_TOKENS = 10
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "Gated DeltaNet layers keep a state of",
]
CHAT = "user: What is a recurrent state?\nassistant:"  # the test servers' role: content template


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


@pytest.fixture(scope="module")
def qwen_server() -> RunningServer:
    flags = ("--num-gpu-blocks-override", str(BLOCKS), "--block-size", "16")
    with launch_server(*flags, model_dir=tiny_model_dir("qwen3_5-gqa")) as server:
        yield server


@pytest.fixture(scope="module")
def client(qwen_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{qwen_server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def expected(qwen_server: RunningServer) -> dict[str, str]:
    """`LLM.generate`'s greedy continuations of `PROMPTS` and the chat prompt."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with VllmRunner(qwen_server.model_dir) as runner:
        outs = runner.generate([*PROMPTS, CHAT], params)
    texts = {o.prompt: o.outputs[0].text for o in outs}
    assert len(set(texts.values())) == len(texts), texts  # varied, so an equality proves much
    return texts


def test_concurrent_completions_equal_llm_generate(
    client: openai.OpenAI, expected: dict[str, str], qwen_server: RunningServer
) -> None:
    def complete(prompt: str) -> str:
        reply = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        return reply.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(complete, PROMPTS * 2))
    assert got == [expected[p] for p in PROMPTS * 2]
    metrics = httpx.get(f"{qwen_server.url}/metrics", timeout=30).text
    assert _metric(metrics, "vllm:kv_cache_blocks_total") == BLOCKS
    assert _metric(metrics, "vllm:kv_cache_usage_perc") == 0.0  # drained


def test_chat_streamed_and_not_equal_llm_generate(
    client: openai.OpenAI, expected: dict[str, str]
) -> None:
    messages = [{"role": "user", "content": "What is a recurrent state?"}]
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert whole.choices[0].message.content == expected[CHAT]
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected[CHAT]


def test_image_in_a_chat_is_a_400_saying_text_only(client: openai.OpenAI) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4000}}
    content = [{"type": "text", "text": "What is in this picture?"}, image]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": content}], max_tokens=4
        )
    message = info.value.body["message"]
    assert "image_url" in message and "text-only" in message
    assert "AAAA" not in message  # the image is not echoed back
    # The server is unharmed: the next request is answered.
    reply = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
