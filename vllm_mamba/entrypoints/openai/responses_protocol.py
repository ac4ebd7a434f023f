"""The OpenAI Responses API subset the server speaks: the request, its translation into a chat
request (input items into messages, function tools into chat tools, `text.format` into
`response_format`), and the output items and response object of the answer.

Input items: messages (`role` user / system / developer / assistant, content as a string or
`input_text` / `output_text` parts), `function_call` items (an earlier call of the model) and
`function_call_output` items (its result), and `reasoning` items (dropped: templates drop
earlier reasoning themselves). Output items: `reasoning` (its text as `reasoning_text`
content), `message` (one `output_text` part) and `function_call`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vllm_mamba.entrypoints.openai.chat_output import ParsedChoice
from vllm_mamba.entrypoints.openai.output_constraints import JsonSchemaSpec, ResponseFormat
from vllm_mamba.entrypoints.openai.protocol import ClientRequest
from vllm_mamba.entrypoints.openai.tool_calls import (
    ChatTool,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
)

# Fields of the Responses API that would change the answer and are not implemented here.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "truncation": (None, "disabled"),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "include": (None, []),
}
# Chat sampling extensions a Responses request may carry too (vLLM's names; send them in
# `extra_body` with the openai client).
_SAMPLING_EXTRAS = (
    "structured_outputs",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


# OpenAI's bounds on `metadata`: at most 16 pairs, keys of at most 64 characters, string
# values of at most 512.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def new_id(prefix: str) -> str:
    """A fresh id such as `resp_3f2a...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(ClientRequest):
    """`POST /v1/responses`."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @field_validator("metadata", mode="before")
    @classmethod
    def _check_metadata(cls, value: Any) -> Any:
        """OpenAI's bounds, checked before pydantic reads the pairs (so a huge or deeply
        nested `metadata` is refused at once, naming the field)."""
        if value is None:
            return value
        if not isinstance(value, dict):
            raise ValueError("must be an object of string keys and string values")
        if len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"may hold at most {MAX_METADATA_KEYS} keys, got {len(value)}")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"keys must be at most {MAX_METADATA_KEY_CHARS} characters")
            if not isinstance(item, str):
                raise ValueError(f"values must be strings, got {type(item).__name__}")
            if len(item) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"values must be at most {MAX_METADATA_VALUE_CHARS} characters")
        return value

    def unsupported_field(self) -> str | None:
        """The first field set that would change the answer and is not implemented."""
        extra = self.model_extra or {}
        for name, allowed in _UNSUPPORTED.items():
            if name in extra and extra[name] not in allowed:
                return name
        return None

    def chat_tools(self) -> list[ChatTool] | None:
        """The function tools as chat tools.

        Raises:
            ValueError: a tool that is not a function (built-in tools are not served here).
        """
        if not self.tools:
            return None
        out = []
        for tool in self.tools:
            if tool.get("type") != "function":
                raise ValueError(
                    f"tools: only function tools are supported, got type {tool.get('type')!r}"
                )
            out.append(
                ChatTool(
                    function=FunctionDefinition(
                        name=tool.get("name", ""),
                        description=tool.get("description"),
                        parameters=tool.get("parameters"),
                        strict=tool.get("strict"),
                    )
                )
            )
        return out

    def chat_tool_choice(self) -> str | NamedToolChoice | None:
        """`tool_choice` in the chat shape.

        Raises:
            ValueError: a choice that is neither a mode nor `{"type": "function", "name"}`.
        """
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return NamedToolChoice(function=NamedFunction(name=choice["name"]))
        raise ValueError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}'
        )

    def response_format(self) -> ResponseFormat | None:
        """`text.format` as a chat `response_format`.

        Raises:
            ValueError: an unknown format type, or json_schema without a schema.
        """
        fmt = (self.text or {}).get("format")
        if not fmt or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return ResponseFormat(type="json_object")
        if fmt.get("type") == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise ValueError("text.format: type json_schema needs a schema object")
            spec = JsonSchemaSpec(
                name=fmt.get("name") or "response",
                description=fmt.get("description"),
                schema=fmt["schema"],
                strict=fmt.get("strict"),
            )
            return ResponseFormat(type="json_schema", json_schema=spec)
        raise ValueError(f"text.format: unknown type {fmt.get('type')!r}")

    def template_kwargs(self) -> dict[str, Any] | None:
        """`reasoning.effort` as the chat template's `reasoning_effort` (vLLM's mapping).

        Raises:
            ValueError: a reasoning option this server does not implement (`summary`).
        """
        reasoning = self.reasoning or {}
        unknown = sorted(k for k, v in reasoning.items() if k != "effort" and v is not None)
        if unknown:
            raise ValueError(
                f"reasoning.{unknown[0]} is not supported: the reasoning is returned as "
                "reasoning_text content"
            )
        effort = reasoning.get("effort")
        return {"reasoning_effort": effort} if effort is not None else None

    def sampling_fields(self) -> dict[str, Any]:
        """The chat sampling fields this request sets (only those given)."""
        fields: dict[str, Any] = {}
        if self.max_output_tokens is not None:
            fields["max_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        extra = self.model_extra or {}
        for name in _SAMPLING_EXTRAS:
            if extra.get(name) is not None:
                fields[name] = extra[name]
        return fields


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of a Responses `input`: consecutive function calls (and the assistant
    text before them) become one assistant message with `tool_calls`; results become tool
    messages.

    Raises:
        ValueError: an item of an unknown type or shape.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            raise ValueError("input: each item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"input: unknown message role {role!r}")
            content = item.get("content")
            text = content if isinstance(content, str) else _parts_content(content)
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise ValueError(f"input: items of type {kind!r} are not supported")
    return messages


def _parts_content(parts: Any) -> str | list[dict[str, Any]]:
    """A message's parts as chat content: their text (`_parts_text`), or, with
    `input_image` parts, chat parts (text parts and the images as they are, which the chat
    side loads or refuses)."""
    if not isinstance(parts, list) or not any(
        isinstance(p, dict) and p.get("type") == "input_image" for p in parts
    ):
        return _parts_text(parts)
    out: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, dict) and part.get("type") == "input_image":
            out.append(part)
        else:
            out.append({"type": "text", "text": _parts_text([part])})
    return out


def _parts_text(parts: Any) -> str:
    """The text of `input_text` / `output_text` parts, joined with newlines."""
    if not isinstance(parts, list):
        raise ValueError("input: content must be a string or a list of text parts")
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"input: only text content parts are supported, got {kind!r}")
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def output_items(parsed: ParsedChoice, status: str) -> list[dict[str, Any]]:
    """The output items of a finished answer."""
    items: list[dict[str, Any]] = []
    if parsed.reasoning:
        items.append(reasoning_item(new_id("rs"), parsed.reasoning, status))
    if parsed.content:
        items.append(message_item(new_id("msg"), parsed.content, status))
    for call in parsed.tool_calls:
        items.append(
            function_call_item(
                new_id("fc"), call.id, call.function.name, call.function.arguments, "completed"
            )
        )
    return items


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A `reasoning` output item."""
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def output_text_part(text: str) -> dict[str, Any]:
    """An `output_text` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant `message` output item (no parts while `text` is None)."""
    content = [output_text_part(text)] if text is not None else []
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": content,
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    """A `function_call` output item."""
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def history_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as the chat messages a follow-up request continues from."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in items:
        if item["type"] == "reasoning" and item["content"]:
            message["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "message":
            message["content"] = "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
    return [message]


class ResponseUsage(BaseModel):
    """`usage` of a response."""

    input_tokens: int = 0
    input_tokens_details: dict[str, int] = Field(
        default_factory=lambda: {"cached_tokens": 0, "cache_write_tokens": 0}
    )
    output_tokens: int = 0
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int = 0


def response_object(
    req: ResponsesRequest,
    response_id: str,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: ResponseUsage | None = None,
    created_at: float | None = None,
) -> dict[str, Any]:
    """The response object (`object: "response"`) in the API's shape."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(created_at or time.time()),
        "status": status,
        "model": model,
        "output": output,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": req.temperature,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": usage.model_dump() if usage is not None else None,
        "user": req.user,
    }
