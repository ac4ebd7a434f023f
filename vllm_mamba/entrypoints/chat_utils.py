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
from datetime import datetime
from typing import Any

from jinja2 import Template, TemplateError

from vllm_mamba.entrypoints.template_sandbox import (
    RENDER_TIMEOUT_S,
    BoundedEnvironment,
    TemplateBudgetError,
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


MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "file")
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
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"{field}: content must be a string or a list of parts")
    pieces = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise ValueError(
                f"{field}: {kind} content parts are not supported: this server serves the "
                "model text-only (images, audio and video are not accepted)"
            )
        if kind not in TEXT_PARTS:
            raise ValueError(f"{field}: only text content parts are supported, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{field}: a text part needs a string text, got {part!r}")
        pieces.append(part["text"])
    return "\n".join(pieces)


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


def conversation_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-style message as the chat template sees it (vLLM's rendering): `role`,
    `content` as text, and, when present, `name`, `tool_calls` (arguments decoded),
    `tool_call_id` and the reasoning of an earlier assistant turn (as `reasoning_content`
    and `reasoning`, the names templates use).

    Raises:
        ValueError: a message without a role, or with a part that is not text.
    """
    role = message.get("role")
    if not isinstance(role, str):
        raise ValueError(f"messages: each message needs a string role, got {message!r}")
    out: dict[str, Any] = {"role": role, "content": content_text(message.get("content"))}
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
    return {"role": out["role"], "content": out["content"]}


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
    final = turns[-1]["content"] if turns else ""
    at = text.rfind(final.strip()) if final.strip() else -1
    if at < 0:
        raise TemplateRenderError(
            "continue_final_message: the final message's content is not in the rendered prompt"
        )
    return text[: at + len(final.strip())]
