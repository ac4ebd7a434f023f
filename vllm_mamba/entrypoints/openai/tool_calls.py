"""Chat tools: the request's `tools` and `tool_choice`, checked; the JSON schema that a
required or named choice generates under (vLLM's way); the call objects of the answer.

- `"auto"` (the default with tools on a server run with `--enable-auto-tool-choice
  --tool-call-parser NAME`): the model writes calls in its own format and the parser finds
  them (`tool_parsers/`); without those flags "auto" is a 400 and no choice means "none".
- `"required"`: the output is a JSON array of one or more `{"name": ..., "parameters": {...}}`
  objects, each matching one tool (an `anyOf` over the tools); every element becomes a tool
  call, and the choice finishes with `"tool_calls"`. `parallel_tool_calls=false` allows one.
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is that
  function's parameters object, returned as its one tool call (finish reason `"stop"`, as
  vLLM does).
- `"none"`: the tools are rendered into the prompt but no call is parsed.

The tools reach the chat template as `tools` (`chat_utils.py`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from vllm_mamba import request_limits as limits
from vllm_mamba.sampling_params import StructuredOutputsParams

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDefinition(BaseModel):
    """A tool's function: its name and JSON schema of parameters."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    """One entry of `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    """The function named by `tool_choice`."""

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming one function."""

    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(BaseModel):
    """A call: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of an assistant message."""

    id: str = Field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    """The function part of a streamed tool call piece: the name in the first piece of a
    call, argument text in it and the pieces after."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a tool call in a streamed delta: `index` says which call; the first piece
    of a call has its `id`, `type` and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @classmethod
    def whole(cls, index: int, call: ToolCall) -> DeltaToolCall:
        """A complete call as one piece."""
        return cls(
            index=index,
            id=call.id,
            type="function",
            function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
        )


class ToolChoiceError(ValueError):
    """`tool_choice` that cannot be served; the message says why."""


class ToolsError(ValueError):
    """`tools` that cannot be served (malformed `$defs`, over the limits); says why."""


def check_tools(tools: list[ChatTool] | None) -> None:
    """Checks `tools` against the request limits.

    Raises:
        ToolsError: too many tools, or definitions too large.
    """
    if not tools:
        return
    size = sum(len(t.model_dump_json()) for t in tools)
    message = limits.over_count("tools", len(tools), limits.MAX_TOOLS) or limits.over_size(
        "tools", size, limits.MAX_TOOLS_BYTES, "bytes"
    )
    if message:
        raise ToolsError(message)


def tool_mode(
    tools: list[ChatTool] | None, choice: str | NamedToolChoice | None, auto_enabled: bool = False
) -> str | None:
    """`"auto"`, `"required"`, `"named"`, or None when the tools are not used.

    No `tool_choice` with tools means "auto" when the server parses calls
    (`--enable-auto-tool-choice`), else "none" (vLLM's default).

    Raises:
        ToolChoiceError: "auto" on a server without a tool-call parser, an unknown choice, or
            a choice without tools.
    """
    if choice is None:
        return "auto" if tools and auto_enabled else None
    if choice == "none":
        return None
    if not tools:
        raise ToolChoiceError("tool_choice needs tools")
    if choice == "auto":
        if not auto_enabled:
            raise ToolChoiceError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set"
            )
        return "auto"
    if choice == "required":
        return "required"
    if isinstance(choice, NamedToolChoice):
        if all(t.function.name != choice.function.name for t in tools):
            raise ToolChoiceError(f"tool_choice names {choice.function.name!r}, not in tools")
        return "named"
    raise ToolChoiceError('tool_choice must be "none", "auto", "required" or a named function')


def tool_structured_outputs(
    tools: list[ChatTool], choice: str | NamedToolChoice, parallel: bool = True
) -> StructuredOutputsParams:
    """The JSON schema that a required or named tool choice generates under (`parallel`:
    more than one call allowed)."""
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        _tool_defs(tool)
        return _params(tool.function.parameters or EMPTY_PARAMETERS)
    items = [
        {
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters or EMPTY_PARAMETERS,
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": items},
    }
    if not parallel:
        schema["maxItems"] = 1
    defs: dict[str, Any] = {}
    owners: dict[str, str] = {}
    for tool in tools:
        for name, definition in _tool_defs(tool).items():
            if name in defs and defs[name] != definition:
                raise ToolsError(
                    f"tools {owners[name]!r} and {tool.function.name!r} both define "
                    f"$defs.{name} differently; give the definitions distinct names"
                )
            defs[name] = definition
            owners.setdefault(name, tool.function.name)
    if defs:
        schema["$defs"] = defs
    return _params(schema)


def _tool_defs(tool: ChatTool) -> dict[str, Any]:
    """The `$defs` of a tool's parameters (the generated schema hoists them to its root).

    Raises:
        ToolsError: `$defs` that is not an object of schemas.
    """
    defs = (tool.function.parameters or {}).get("$defs", {})
    if not isinstance(defs, dict) or not all(isinstance(d, (dict, bool)) for d in defs.values()):
        raise ToolsError(
            f"tools: the parameters of {tool.function.name!r} have $defs that is not an "
            "object mapping names to schemas"
        )
    return defs


def _params(schema: dict[str, Any]) -> StructuredOutputsParams:
    """The structured-outputs parameters of a tools schema (over the limits: ToolsError)."""
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as err:
        raise ToolsError(
            str(err).replace("SamplingParams.structured_outputs.json", "tools")
        ) from err


def parse_tool_calls(text: str, choice: str | NamedToolChoice) -> list[ToolCall] | None:
    """The tool calls in a generated text; None when it is not complete JSON (cut by length)."""
    if isinstance(choice, NamedToolChoice):
        try:
            json.loads(text)
        except ValueError:
            return None
        return [ToolCall(function=FunctionCall(name=choice.function.name, arguments=text))]
    try:
        return [
            ToolCall(function=FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"])))
            for c in json.loads(text)
        ]
    except (ValueError, TypeError, KeyError):  # cut short (a stop string, max_tokens)
        return None
