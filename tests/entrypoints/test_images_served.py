"""Images through the OpenAI server with the official `openai` client, on a tiny Qwen3.5
image-text checkpoint: `image_url` chat parts as data URLs, as http URLs from a loopback image
server and as `file://` URLs under `--allowed-local-media-path`, streamed and not, and the
Responses API's `input_image`, each giving what `LLM.chat` gives for the same images; bad images
(undecodable, too many, a 404, a slow server, a path outside the allowed directory) are 400s
naming the part, and the server stays healthy."""

from __future__ import annotations

import base64
import io
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, RunningServer, launch_server
from tests.helpers.image_checkpoints import QWEN_TEMPLATE, qwen3_5_image_text, random_image
from tests.helpers.runners import VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from vllm_mamba import SamplingParams

MAX_TOKENS = 8
PROMPT_IDS: dict[str, list[int]] = {}  # `LLM.chat`'s prompts, filled by `expected`
QUESTION = "What is in this picture?"
pytestmark = pytest.mark.xdist_group("images-served")


def _png(image) -> bytes:  # noqa: ANN001 - a PIL image
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


IMAGES = {"one.png": random_image(50, 70, 0), "two.png": random_image(40, 90, 1)}


class _Images(BaseHTTPRequestHandler):
    """Serves `IMAGES` as PNG; `/slow.png` after 5 s; anything else is a 404."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        name = self.path.lstrip("/")
        if name == "slow.png":
            time.sleep(5)
            name = "one.png"
        if name in IMAGES:
            body = _png(IMAGES[name])
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except BrokenPipeError:  # the slow image's reader gave up: as it should
                pass
            return
        self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def media_dir() -> str:
    path = make_tmp_dir("served-media-")
    for name, image in IMAGES.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(_png(image))
    return path


@pytest.fixture(scope="module")
def server(media_dir: str) -> Iterator[RunningServer]:
    flags = (
        "--chat-template", QWEN_TEMPLATE, "--allowed-local-media-path", media_dir,
        "--limit-mm-per-prompt", json.dumps({"image": 2}), "--media-fetch-timeout", "1",
    )  # fmt: skip
    with launch_server(*flags, model_dir=qwen3_5_image_text()) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def expected(server: RunningServer) -> dict[str, str]:
    """`LLM.chat`'s greedy answers to `QUESTION` about each image, and about both."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    out = {}
    with VllmRunner(server.model_dir) as runner:
        for key, images in (("one", ["one.png"]), ("two", ["two.png"]), ("both", list(IMAGES))):
            parts = [{"type": "image_pil", "image_pil": IMAGES[n]} for n in images]
            messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, *parts]}]
            reply = runner.llm.chat(messages, params, use_tqdm=False)[0]
            out[key] = reply.outputs[0].text
            PROMPT_IDS[key] = reply.prompt_token_ids
    assert len(set(out.values())) == len(out), out  # the images change the answer
    return out


def _data_url(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(IMAGES[name])).decode()


def _chat(client: openai.OpenAI, *urls: str, stream: bool = False) -> str:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, *parts]}]
    kwargs = dict(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(**kwargs, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_data_urls_streamed_and_not(client: openai.OpenAI, expected: dict[str, str]) -> None:
    assert _chat(client, _data_url("one.png")) == expected["one"]
    assert _chat(client, _data_url("two.png"), stream=True) == expected["two"]
    assert _chat(client, _data_url("one.png"), _data_url("two.png")) == expected["both"]


def test_http_and_file_urls(
    client: openai.OpenAI, expected: dict[str, str], image_server: str, media_dir: str
) -> None:
    assert _chat(client, f"{image_server}/one.png") == expected["one"]
    assert _chat(client, f"file://{media_dir}/two.png") == expected["two"]


def test_responses_input_image(client: openai.OpenAI, expected: dict[str, str]) -> None:
    content = [
        {"type": "input_text", "text": QUESTION},
        {"type": "input_image", "image_url": _data_url("one.png"), "detail": "auto"},
    ]
    reply = client.responses.create(
        model=MODEL_NAME,
        input=[{"role": "user", "content": content}],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert reply.output_text == expected["one"]


def test_tokenize_expands_images_as_the_engine(
    server: RunningServer, expected: dict[str, str]
) -> None:
    """`/tokenize` of chat messages with images gives the ids the engine runs: each image's
    placeholder expanded (the count is what counts against `max_model_len`)."""
    import httpx

    parts = [{"type": "text", "text": QUESTION}]
    parts += [{"type": "image_url", "image_url": {"url": _data_url(n)}} for n in IMAGES]
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": parts}]}
    reply = httpx.post(f"{server.url}/tokenize", json=body, headers=server.headers, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["tokens"] == PROMPT_IDS["both"]
    assert reply.json()["count"] > 2 * len(IMAGES) + 10  # expanded, not one per image


def test_bad_images_are_400s_naming_the_part(
    client: openai.OpenAI, image_server: str, media_dir: str
) -> None:
    outside = make_tmp_dir("outside-media-")
    with open(os.path.join(outside, "x.png"), "wb") as f:
        f.write(_png(IMAGES["one.png"]))
    cases = [
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "content[1]"),
        (f"{image_server}/missing.png", "404"),
        (f"file://{outside}/x.png", "allowed-local-media-path"),
        (f"file://{media_dir}/../{os.path.basename(outside)}/x.png", "content[1]"),
        ("ftp://example.com/x.png", "content[1]"),
    ]
    for url, needle in cases:
        with pytest.raises(openai.BadRequestError) as info:
            _chat(client, url)
        message = info.value.body["message"]
        assert "messages[0]" in message and needle in message, message
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError):
        _chat(client, f"{image_server}/slow.png")
    assert time.monotonic() - start < 4  # the 1 s fetch budget, not the server's 5 s
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, *[_data_url("one.png")] * 3)
    assert "limit-mm-per-prompt" in info.value.body["message"]
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": [audio]}], max_tokens=2
        )
    assert (
        "messages[0].content[0]: input_audio parts are not supported (only images)"
        in (info.value.body["message"])
    )
    # the server is unharmed
    reply = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
