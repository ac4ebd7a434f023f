"""Images in the web chat page, in a real headless Chromium against a real server on a tiny
Qwen3.5 image-text checkpoint: files picked with the page's file input (and its "Attach image"
button) become thumbnails that can be removed, go out as OpenAI `image_url` data-URL parts
after the text (an image-only message has no text part), stay in the conversation for the next
turns, and the greedy replies equal `LLM.chat`'s; non-images and files over 6 MB are refused
on the page without a request; a 400 from the server shows and gives the images back.

Chromium is required (the test fails, saying how to install it, when it is missing).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from tests.entrypoints.chromium import INSTALL_HINT, Page, browser_path, headless_chromium
from tests.entrypoints.conftest import API_KEY, MODEL_NAME, launch_server
from tests.helpers.image_checkpoints import QWEN_TEMPLATE, qwen3_5_image_text, random_image
from tests.helpers.runners import VllmRunner
from vllm_mamba import SamplingParams

MAX_TOKENS = 6
QUESTION = "What is in this picture?"
FOLLOW_UP = "And what colour is it?"
IMAGES = {
    "one.png": random_image(50, 70, 0),
    "two.png": random_image(40, 90, 1),
    "three.png": random_image(30, 30, 2),
}
LAST_ASSISTANT = "[...document.querySelectorAll('.msg.assistant')].at(-1)"
THUMBS = "document.querySelectorAll('#attachments .thumb')"
CHAT_REQUESTS = (
    "performance.getEntriesByType('resource')"
    ".filter(e => e.name.endsWith('/v1/chat/completions')).length"
)
pytestmark = pytest.mark.xdist_group("images-served")


def _expected(model_dir: str) -> tuple[str, str]:
    """`LLM.chat`'s greedy answers to `QUESTION` about one.png, and then to `FOLLOW_UP`."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    image = {"type": "image_pil", "image_pil": IMAGES["one.png"]}
    asked = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, image]}]
    with VllmRunner(model_dir) as runner:
        first = runner.llm.chat(asked, params, use_tqdm=False)[0].outputs[0].text
        asked += [
            {"role": "assistant", "content": first},
            {"role": "user", "content": FOLLOW_UP},
        ]
        second = runner.llm.chat(asked, params, use_tqdm=False)[0].outputs[0].text
    return first, second


def _pick_files(page: Page, *paths: Path) -> None:
    """Sets the page's file input to `paths`, as a pick in the file chooser does (DevTools
    fires its input and change events)."""
    node = page.send("Runtime.evaluate", expression="document.getElementById('file')")
    files = [str(p) for p in paths]
    page.send("DOM.setFileInputFiles", files=files, objectId=node["result"]["objectId"])


def _pick_with_button(page: Page, *paths: Path) -> None:
    """Clicks "Attach image" and answers the file chooser it opens with `paths`."""
    page.send("Page.setInterceptFileChooserDialog", enabled=True)
    try:
        page.click("#attach")
        chooser = page.wait_event("Page.fileChooserOpened")
        assert chooser["mode"] == "selectMultiple"
        files = [str(p) for p in paths]
        page.send("DOM.setFileInputFiles", files=files, backendNodeId=chooser["backendNodeId"])
    finally:
        page.send("Page.setInterceptFileChooserDialog", enabled=False)


def _send(page: Page) -> dict:
    """Clicks Send; the chat request the page made (let through to the server)."""
    page.send("Fetch.enable", patterns=[{"urlPattern": "*/v1/chat/completions"}])
    try:
        page.click("#send")
        paused = page.wait_event("Fetch.requestPaused")
        page.send("Fetch.continueRequest", requestId=paused["requestId"])
    finally:
        page.send("Fetch.disable")
    return json.loads(paused["request"]["postData"])


def _wait_reply(page: Page) -> str:
    """Waits until the last reply has ended; returns its state."""
    page.wait_for(
        f"{LAST_ASSISTANT} && {LAST_ASSISTANT}.dataset.state !== 'streaming'",
        30,
        "the reply to end",
    )
    return page.eval(f"{LAST_ASSISTANT}.dataset.state")


def _image_part(path: Path) -> dict:
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def test_web_ui_sends_images(tmp_path: Path) -> None:
    if browser_path() is None:
        pytest.fail(INSTALL_HINT)
    files = {}
    for name, image in IMAGES.items():
        files[name] = tmp_path / name
        image.save(files[name], format="PNG")
    notes, big = tmp_path / "notes.txt", tmp_path / "big.png"
    notes.write_text("not an image")
    big.write_bytes(b"\x89PNG" + bytes(6 * 2**20))  # over the page's 6 MB
    model_dir = qwen3_5_image_text()
    first, second = _expected(model_dir)

    flags = ("--chat-template", QWEN_TEMPLATE, "--limit-mm-per-prompt", '{"image": 2}')
    with launch_server(*flags, model_dir=model_dir) as server, headless_chromium() as page:
        page.navigate(f"{server.url}/")
        page.type_into("#api-key", API_KEY)
        page.click("#save-key")
        page.wait_for(f"document.getElementById('model-name').textContent === '{MODEL_NAME}'")
        for field, value in {
            "temperature": "0",
            "top_p": "1",
            "max_tokens": str(MAX_TOKENS),
        }.items():
            page.type_into(f"#{field}", value)

        # A file that is not an image, and one too large: refused, nothing attached or sent.
        _pick_files(page, notes, big)
        error = page.wait_for("document.getElementById('attach-error').textContent")
        assert "notes.txt is not an image" in error and "big.png is larger than 6 MB" in error
        assert page.eval("document.getElementById('attachments').hidden")
        page.click("#send")
        assert page.eval("document.querySelectorAll('.msg').length") == 0
        assert page.eval(CHAT_REQUESTS) == 0

        # Three images where the server takes two: its 400 shows, and the turn's text and
        # images come back to the composer.
        _pick_with_button(page, files["one.png"], files["two.png"], files["three.png"])
        page.wait_for(f"{THUMBS}.length === 3", what="three thumbnails")
        assert page.eval("document.getElementById('attach-error').hidden")
        page.type_into("#input", QUESTION)
        page.click("#send")
        error = page.wait_for("document.querySelector('.error')?.textContent", what="an error")
        assert "limit-mm-per-prompt" in error and "invalid_request_error" in error
        assert page.eval("document.querySelectorAll('.msg').length") == 0
        assert page.eval("document.getElementById('input').value") == QUESTION
        names = page.eval(f"[...{THUMBS}].map(t => t.querySelector('img').alt)")
        assert names == ["one.png", "two.png", "three.png"]

        # Two removed with their x: the question goes with one image, after the text.
        page.click("#attachments .thumb:nth-child(2) .remove")
        page.click("#attachments .thumb:nth-child(2) .remove")
        assert page.eval(f"[...{THUMBS}].map(t => t.querySelector('img').alt)") == ["one.png"]
        one = _image_part(files["one.png"])
        request = _send(page)
        assert request["messages"] == [
            {"role": "user", "content": [{"type": "text", "text": QUESTION}, one]}
        ]
        assert _wait_reply(page) in ("length", "stop")
        assert page.eval(f"{LAST_ASSISTANT}.querySelector('.content').dataset.source") == first
        shown = page.eval("[...document.querySelectorAll('.msg.user img')].map(i => i.src)")
        assert shown == [one["image_url"]["url"]]
        assert page.eval(f"{THUMBS}.length") == 0
        assert page.eval("document.getElementById('attachments').hidden")

        # A follow-up sends the image again with the history.
        page.type_into("#input", FOLLOW_UP)
        request = _send(page)
        assert request["messages"][0]["content"][1] == one
        assert request["messages"][1:] == [
            {"role": "assistant", "content": first},
            {"role": "user", "content": FOLLOW_UP},
        ]
        assert _wait_reply(page) in ("length", "stop")
        assert page.eval(f"{LAST_ASSISTANT}.querySelector('.content').dataset.source") == second

        # An image alone is a message: no text part.
        _pick_files(page, files["two.png"])
        page.wait_for(f"{THUMBS}.length === 1", what="a thumbnail")
        request = _send(page)
        assert request["messages"][-1] == {
            "role": "user",
            "content": [_image_part(files["two.png"])],
        }
        assert _wait_reply(page) in ("length", "stop")
        assert page.eval("document.querySelectorAll('.msg.user').length") == 3
        last_user = "[...document.querySelectorAll('.msg.user')].at(-1)"
        assert page.eval(f"{last_user}.querySelectorAll('img').length") == 1
        assert page.problems() == []
