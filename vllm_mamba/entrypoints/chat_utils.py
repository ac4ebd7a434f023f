"""Chat templates: which one a model uses (and where it came from), and rendering
conversations with it in a Jinja sandbox that bounds time and output size.

The template is `--chat-template` / `chat_template=` (a file or the template text), else the
tokenizer's. A model with neither cannot chat: rendering is a `ValueError` that names
`--chat-template` (vLLM's behaviour), never a template nobody chose. A template sent in a
request is used only when the server runs with `--trust-request-chat-template` (vLLM's flag).
Every render runs in an immutable sandbox that stops after `RENDER_TIMEOUT_S` seconds or
`MAX_RENDER_CHARS` characters, so no template can hold a worker for long or fill the memory.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

NO_TEMPLATE_MESSAGE = (
    "the model has no chat template: give one with --chat-template (a file or the template "
    "text), or chat_template= in Python"
)
RENDER_TIMEOUT_S = 2.0
MAX_RENDER_CHARS = 4_000_000
_MAX_POWER = 1_000


class TemplateRenderError(ValueError):
    """A template that cannot render these messages, ran too long or produced too much."""


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """A sandbox whose calls, attribute lookups and `*` / `**` check a deadline and sizes."""

    intercepted_binops = frozenset(["*", "**"])

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        self._local = threading.local()  # each thread renders against its own deadline

    def set_deadline(self, deadline: float) -> None:
        """Renders on this thread stop once `time.monotonic()` passes `deadline`."""
        self._local.deadline = deadline

    def _check_time(self) -> None:
        if time.monotonic() > getattr(self._local, "deadline", float("inf")):
            raise SecurityError(f"the chat template ran for more than {RENDER_TIMEOUT_S} s")

    def call(self, context: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        self._check_time()
        return super().call(context, obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self._check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self._check_time()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self._check_time()
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > _MAX_POWER:
            raise SecurityError("the chat template raised a number to a too large power")
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                    if len(seq) * count > MAX_RENDER_CHARS:
                        raise SecurityError("the chat template built a too large value")
        return super().call_binop(context, operator, left, right)


_ENV = _BoundedEnvironment()


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, **kwargs)


_ENV.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
_ENV.filters["tojson"] = _tojson


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    return _ENV.from_string(source)


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
        self, turns: list[dict[str, str]], add_generation_prompt: bool, template: str | None = None
    ) -> str:
        """The prompt text of a conversation (call it off the event loop).

        Raises:
            TemplateRenderError: the template failed, ran too long or produced too much.
            ValueError: there is no template at all.
        """
        source = template or self.template
        if source is None:
            raise ValueError(NO_TEMPLATE_MESSAGE)
        try:
            compiled = _compile(source)
            _ENV.set_deadline(time.monotonic() + RENDER_TIMEOUT_S)
            text = compiled.render(
                messages=turns, add_generation_prompt=add_generation_prompt, **self.special
            )
        except (TemplateError, TypeError, ValueError, RecursionError) as err:
            raise TemplateRenderError(f"cannot apply the chat template: {err}") from err
        finally:
            _ENV.set_deadline(float("inf"))
        if len(text) > MAX_RENDER_CHARS:
            raise TemplateRenderError(
                f"the chat template produced more than {MAX_RENDER_CHARS} characters"
            )
        return text


MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "file")


def message_text(message: dict[str, Any]) -> dict[str, str]:
    """`{"role", "content"}` of an OpenAI-style message whose content is text or text parts.

    Raises:
        ValueError: a message without a role, or with a part that is not text.
    """
    role = message.get("role")
    if not isinstance(role, str):
        raise ValueError(f"messages: each message needs a string role, got {message!r}")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return {"role": role, "content": content or ""}
    pieces = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise ValueError(
                f"messages: {kind} content parts are not supported: this server serves the "
                "model text-only (images, audio and video are not accepted)"
            )
        if kind != "text":
            raise ValueError(f"messages: only text content parts are supported, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"messages: a text part needs a string text, got {part!r}")
        pieces.append(part["text"])
    return {"role": role, "content": "".join(pieces)}
