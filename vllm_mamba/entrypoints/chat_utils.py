"""Chat templates: which one a model uses (and where it came from), and rendering
conversations with it in a Jinja sandbox that bounds time and output size.

The template is `--chat-template` / `chat_template=` (a file or the template text), else the
tokenizer's. A model with neither cannot chat: rendering is a `ValueError` that names
`--chat-template` (vLLM's behaviour), never a template nobody chose. A template sent in a
request is used only when the server runs with `--trust-request-chat-template` (vLLM's flag).
Every render runs in the bounded sandbox of `template_sandbox.py`: it stops after
`RENDER_TIMEOUT_S` seconds (renders inside one `render_budget()` share them) and refuses any
value or output over its `MAX_RENDER_CHARS` characters before building it, so no template can
hold a worker for long or fill the memory; a request's template is at most
`MAX_REQUEST_TEMPLATE_CHARS` long, and the compiled templates kept are bounded in number and
size.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import Template, TemplateError

from vllm_mamba.entrypoints.template_sandbox import (
    RENDER_TIMEOUT_S,
    BoundedEnvironment,
    TemplateBudgetError,
)
from vllm_mamba.multimodal.media import (
    MediaConfig,
    image_from_pil,
    load_image,
    load_image_async,
)

NO_TEMPLATE_MESSAGE = (
    "the model has no chat template: give one with --chat-template (a file or the template "
    "text), or chat_template= in Python"
)
MAX_REQUEST_TEMPLATE_CHARS = 100_000  # a request's chat_template (the largest known are ~20k)
_CACHE_MAX_TEMPLATES = 16
_CACHE_MAX_CHARS = 1_000_000  # the source characters of all compiled templates kept
_MAX_STRFTIME_FORMAT = 256


class TemplateRenderError(ValueError):
    """A template that cannot render these messages, ran too long or produced too much."""


_ENV = BoundedEnvironment()


def render_budget(resume: bool = False) -> contextlib.AbstractContextManager[None]:
    """Every render on this thread inside shares one deadline, `RENDER_TIMEOUT_S` from entry,
    or with `resume` the deadline of the thread's last render (see `chat_cache_points`)."""
    return _ENV.budget(RENDER_TIMEOUT_S, resume)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > _MAX_STRFTIME_FORMAT:
        raise TemplateBudgetError(
            f"strftime_now takes a format of at most {_MAX_STRFTIME_FORMAT} characters"
        )
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: Any = None, **kwargs: Any) -> str:
    separators = kwargs.get("separators") or ("", "")
    per_item = 4 + sum(len(_ENV.to_text(sep)) for sep in separators)
    width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    _ENV.text_size(value, per_item=per_item, indent=max(width, 0))
    return json.dumps(value, ensure_ascii=False, indent=indent, **kwargs)


_ENV.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
_ENV.set_filter("tojson", _tojson)
_CACHE: OrderedDict[str, Template] = OrderedDict()
_CACHE_LOCK = threading.Lock()


def _compile(source: str) -> Template:
    """The compiled template of `source`; the last few that compiled are kept (a bounded
    number and total size), a template that fails to compile is not.

    Raises:
        TemplateError: the template does not compile.
    """
    with _CACHE_LOCK:
        compiled = _CACHE.get(source)
        if compiled is not None:
            _CACHE.move_to_end(source)
            return compiled
    try:
        compiled = _ENV.from_string(source)
    except TemplateError:
        raise
    except (RecursionError, SyntaxError, MemoryError) as err:  # nesting Python cannot compile
        raise TemplateError(f"the template is nested too deeply: {type(err).__name__}") from None
    if len(source) <= _CACHE_MAX_CHARS // 4:
        with _CACHE_LOCK:
            _CACHE[source] = compiled
            while len(_CACHE) > _CACHE_MAX_TEMPLATES or sum(map(len, _CACHE)) > _CACHE_MAX_CHARS:
                _CACHE.popitem(last=False)
    return compiled


class ChatTemplate:
    """The server's chat template and the renderer of conversations.

    Args:
        tokenizer: the model's tokenizer (its `chat_template` and special tokens).
        override: `--chat-template`, a file path or the template text.

    Raises:
        ValueError: a template that does not compile.
        trust_request_templates: allow a `chat_template` sent with a request.
    """

    def __init__(
        self,
        tokenizer: Any,
        override: str | None = None,
        trust_request_templates: bool = False,
    ) -> None:
        self.trust_request_templates = trust_request_templates
        self.special = {
            name: str(getattr(tokenizer, name, None) or "")
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        if override:
            if os.path.isfile(override):
                with open(override, encoding="utf-8") as f:
                    self.template, self.source = f.read(), f"--chat-template file {override}"
            else:
                self.template, self.source = override, "--chat-template text"
        elif isinstance(getattr(tokenizer, "chat_template", None), str):
            self.template, self.source = tokenizer.chat_template, "the tokenizer's"
        else:
            self.template, self.source = None, "none (chat needs --chat-template)"
        try:
            if self.template is not None:
                _compile(self.template)
        except TemplateError as err:
            raise ValueError(f"chat template ({self.source}) does not compile: {err}") from err

    def check_request_template(self, template: str | None) -> None:
        """A request's own template is refused unless the server trusts them.

        Raises:
            ValueError: naming `chat_template`.
        """
        if template is not None and not self.trust_request_templates:
            raise ValueError(
                "chat_template in a request is only accepted when the server runs with "
                "--trust-request-chat-template"
            )

    def render(
        self,
        turns: list[dict[str, Any]],
        add_generation_prompt: bool,
        template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text of a conversation (call it off the event loop).

        Args:
            turns: messages as `conversation_message` makes them.
            add_generation_prompt: end with the start of an assistant turn.
            template: a template to use instead of the server's.
            tools: the request's tools (OpenAI's `{"type": "function", "function": ...}`),
                passed to the template as `tools` (None when there are none).
            documents: passed to the template as `documents` (retrieval templates).
            template_kwargs: extra template variables (`chat_template_kwargs`, checked by
                `check_template_kwargs`), e.g. `enable_thinking`.
            continue_final_message: the prompt ends inside the last message (its end-of-turn
                text is cut off), so that the model continues it (vLLM's flag).

        Raises:
            TemplateRenderError: the template failed, ran too long or produced too much.
            ValueError: there is no template at all.
        """
        source = template or self.template
        if source is None:
            raise ValueError(NO_TEMPLATE_MESSAGE)
        if template is not None and len(template) > MAX_REQUEST_TEMPLATE_CHARS:
            raise TemplateRenderError(
                f"chat_template is {len(template)} characters long, more than the limit of "
                f"{MAX_REQUEST_TEMPLATE_CHARS}"
            )
        try:
            with render_budget():
                _ENV.check_time()  # a shared budget already spent renders nothing more
                compiled = _compile(source)
                _ENV.start_render()
                text = compiled.render(
                    **(template_kwargs or {}),
                    messages=turns,
                    tools=tools or None,
                    documents=documents or None,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    **self.special,
                )
        except Exception as err:  # noqa: BLE001 - whatever the template does is its failure
            raise TemplateRenderError(f"cannot apply the chat template: {err}") from err
        if continue_final_message:
            text = _cut_after_final_message(text, turns)
        return text


MEDIA_PARTS = (
    "image_url", "input_image", "image", "image_pil", "input_audio", "audio_url", "video_url",
    "file",
)  # fmt: skip
IMAGE_PARTS = ("image_url", "input_image", "image", "image_pil")
TEXT_PARTS = ("text", "input_text", "output_text")
# Names the renderer sets itself: `chat_template_kwargs` may not override them.
RESERVED_TEMPLATE_VARS = frozenset(
    ["messages", "tools", "documents", "add_generation_prompt", "continue_final_message"]
    + ["bos_token", "eos_token", "pad_token", "unk_token", "chat_template"]
)
MAX_TEMPLATE_KWARGS_BYTES = 65_536


def content_text(content: Any, field: str = "messages") -> str:
    """The text of a message's content: a string, or text parts joined with newlines (vLLM's
    "string" content format).

    Raises:
        ValueError: a part that is not text (media parts are named), naming `field`.
    """
    out = content_parts(content, field, None)
    assert isinstance(out, str)
    return out


def content_parts(content: Any, field: str, images: list[ImageRef] | None) -> str | list[Any]:
    """A message's content as the chat template sees it: its text (`content_text`) when it
    has no image, else its parts in order, text as `{"type": "text", "text": ...}` and each
    image as `{"type": "image"}` (the form Qwen's and LFM2-VL's templates read), the images'
    references appended to `images`. `images` None: images are refused.

    Raises:
        ValueError: naming `field`: a part that is neither text nor an image (nor an image
            when `images` is None), or a malformed part.
    """
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"{field}: content must be a string or a list of parts")
    pieces: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"{field}.content[{i}]"
        if kind in IMAGE_PARTS and images is not None:
            images.append(image_ref(part, where))
            pieces.append({"type": "image"})
            continue
        if kind in MEDIA_PARTS and images is None:
            raise ValueError(
                f"{field}: {kind} content parts are not supported: this server serves the "
                "model text-only (images, audio and video are not accepted)"
            )
        if kind in MEDIA_PARTS:  # audio, video, files: an image-text model takes images only
            raise ValueError(f"{where}: {kind} parts are not supported (only images)")
        if kind not in TEXT_PARTS:
            raise ValueError(f"{field}: only text content parts are supported, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{field}: a text part needs a string text, got {part!r}")
        pieces.append({"type": "text", "text": part["text"]})
    if not any(p["type"] == "image" for p in pieces):
        return "\n".join(p["text"] for p in pieces)
    return pieces


@dataclass(frozen=True)
class ImageRef:
    """An image part of a message: its URL (`data:`, `http(s)://`, `file://`) or, from
    `LLM.chat`, the image itself; `field` names the part in errors."""

    field: str
    url: str | None = None
    image: Any = None


def image_ref(part: dict[str, Any], field: str) -> ImageRef:
    """The image an image part names: `image_url` (`{"url": ...}` or a string),
    `input_image` (Responses: `image_url` string), `image_pil` / `image` (a PIL image or a
    URL string, `LLM.chat`).

    Raises:
        ValueError: naming `field`: no URL or image, or a Responses `file_id`.
    """
    kind = part["type"]
    value = part.get(kind if kind != "input_image" else "image_url")
    if kind == "input_image" and value is None and part.get("file_id") is not None:
        raise ValueError(f"{field}: input_image file_id is not supported (send image_url)")
    if isinstance(value, dict) and kind == "image_url":
        value = value.get("url")
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{field}: the image URL is empty")
        return ImageRef(field, url=value)
    if value is None or kind in ("image_url", "input_image"):
        raise ValueError(f"{field}: an {kind} part needs an image URL")
    return ImageRef(field, image=value)


def load_images(refs: list[ImageRef], media: MediaConfig) -> list[Any]:
    """The decoded RGB images of `refs`, in order (URLs read under `media`'s rules; call off
    the event loop).

    Raises:
        ValueError: naming the part: an image that cannot be read or decoded.
    """
    return [
        load_image(ref.url, media, ref.field)
        if ref.url is not None
        else image_from_pil(ref.image, media, ref.field)
        for ref in refs
    ]


async def load_images_async(refs: list[ImageRef], media: MediaConfig) -> list[Any]:
    """`load_images` on worker threads, the images fetched concurrently."""
    import asyncio

    async def one(ref: ImageRef) -> Any:
        if ref.url is not None:
            return await load_image_async(ref.url, media, ref.field)
        return await asyncio.to_thread(image_from_pil, ref.image, media, ref.field)

    return list(await asyncio.gather(*(one(ref) for ref in refs)))


def template_content_text(content: str | list[Any]) -> str:
    """The text of a template message's content (its text parts joined)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's earlier tool call as templates read it: its arguments as a
    dict when they are a JSON object (vLLM's conversion; Qwen's and Llama's templates
    iterate them), else as sent.

    Raises:
        ValueError: a call without a function name.
    """
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"messages: a tool call needs function.name, got {call!r}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            decoded = None
        if isinstance(decoded, dict):
            arguments = decoded
    out = {k: v for k, v in call.items() if k != "function"}
    out.setdefault("type", "function")
    out["function"] = {**function, "arguments": arguments}
    return out


def conversation_message(
    message: dict[str, Any], images: list[ImageRef] | None = None, field: str = "messages"
) -> dict[str, Any]:
    """An OpenAI-style message as the chat template sees it (vLLM's rendering): `role`,
    `content` as text (or, with images, its parts: `content_parts`), and, when present,
    `name`, `tool_calls` (arguments decoded), `tool_call_id` and the reasoning of an earlier
    assistant turn (as `reasoning_content` and `reasoning`, the names templates use).

    Args:
        images: where its image parts' references go; None refuses image parts.
        field: the message's name in errors (`messages[2]`).

    Raises:
        ValueError: a message without a role, or with a part that is not text (or an image
            when `images` is given).
    """
    role = message.get("role")
    if not isinstance(role, str):
        raise ValueError(f"messages: each message needs a string role, got {message!r}")
    content = content_parts(message.get("content"), field, images)
    out: dict[str, Any] = {"role": role, "content": content}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [template_tool_call(c) for c in calls]
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning is not None:
        out["reasoning_content"] = out["reasoning"] = content_text(reasoning)
    return out


def message_text(message: dict[str, Any]) -> dict[str, str]:
    """`{"role", "content"}` of an OpenAI-style message whose content is text or text parts.

    Raises:
        ValueError: a message without a role, or with a part that is not text.
    """
    out = conversation_message(message)
    return {"role": out["role"], "content": template_content_text(out["content"])}


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs` checked: a JSON object of bounded size that overrides none of
    the variables the renderer sets.

    Raises:
        ValueError: naming `chat_template_kwargs`.
    """
    if not kwargs:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be an object")
    clash = sorted(RESERVED_TEMPLATE_VARS & set(kwargs))
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")
    size = len(json.dumps(kwargs, default=str))
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(
            f"chat_template_kwargs is {size} bytes long, more than the limit of "
            f"{MAX_TEMPLATE_KWARGS_BYTES}"
        )
    return kwargs


def _cut_after_final_message(text: str, turns: list[dict[str, Any]]) -> str:
    """The prompt cut right after the last message's content (what the template added after
    it, its end-of-turn markers, is dropped), as vLLM's `continue_final_message` does.

    Raises:
        ValueError: the last message's content is not found in the prompt.
    """
    final = template_content_text(turns[-1]["content"]) if turns else ""
    at = text.rfind(final.strip()) if final.strip() else -1
    if at < 0:
        raise TemplateRenderError(
            "continue_final_message: the final message's content is not in the rendered prompt"
        )
    return text[: at + len(final.strip())]
