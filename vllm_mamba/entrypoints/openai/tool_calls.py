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
- either cut short by `max_tokens`: finish reason `"length"` and the calls so far, the last
  one's arguments partial (`ForcedCalls` reads the output as it streams in; the arguments are
  the generated text, never re-serialised).
- `"none"`: the tools are rendered into the prompt but no call is parsed.

The tools reach the chat template as `tools` (`chat_utils.py`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from vllm_mamba import request_limits as limits
from vllm_mamba.sampling_params import StructuredOutputsParams

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


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

    id: str = Field(default_factory=_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class _SetFieldsOnly(BaseModel):
    """Serialised without the fields that are None, as OpenAI's stream pieces are."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_SetFieldsOnly):
    """The function part of a streamed tool call piece: the name in the first piece of a
    call, argument text in it and the pieces after."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_SetFieldsOnly):
    """A piece of a tool call in a streamed delta: `index` says which call; the first piece
    of a call has its `id`, `type` and name, the later ones only argument text (OpenAI's
    stream: `{"index": 0, "function": {"arguments": "..."}}`)."""

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


@dataclass
class _Call:
    """One call being read: its name once known, its argument text in pieces."""

    name: str | None = None
    args: list[str] = field(default_factory=list)
    id: str = field(default_factory=_call_id)
    done: bool = False  # its element has closed
    sent: int = -1  # pieces of `args` sent (-1: the call's first piece not sent yet)

    def tool_call(self) -> ToolCall:
        assert self.name is not None
        return ToolCall(id=self.id, function=FunctionCall(name=self.name, arguments=self.text))

    @property
    def text(self) -> str:
        return "".join(self.args)


class ForcedCalls:
    """Reads the JSON a required or named tool choice generates, as it streams in (work
    proportional to the new text), into calls whose arguments are the generated text itself.

    A named choice's whole output is its one call's arguments. A required choice's output is
    `[{"name": ..., "parameters": {...}}, ...]`: each element is a call, named by its `name`
    string and with the text of its `parameters` value as arguments (in whichever order the
    two come). The text need not be complete: a call cut short (by `max_tokens`) has the
    arguments generated so far, and one cut before its name is complete is not a call yet.
    The arguments are never re-serialised, so what a stream sent adds up to what a whole
    answer holds, numbers and escapes as generated.
    """

    def __init__(self, choice: str | NamedToolChoice) -> None:
        self.named = isinstance(choice, NamedToolChoice)
        self.calls: list[_Call] = []
        if isinstance(choice, NamedToolChoice):
            self.calls.append(_Call(name=choice.function.name))
        self.depth = 0
        self.opened = False  # a JSON value has begun
        self.in_string = False
        self.escape = False
        self.expect_key = False  # in a required element, a key comes next
        self.key: str | None = None  # the key whose value is being read
        self.capture: list[str] | None = None  # raw text of the key or name being read
        self.args: bool | None = None  # None: not in parameters; True: reading; False: done
        self.first_unsent = 0  # calls before it are sent whole

    @property
    def complete(self) -> bool:
        """The JSON value has ended (a number at the very end counts as ended)."""
        return self.opened and self.depth == 0 and not self.in_string

    def feed(self, text: str) -> None:
        """Reads the next piece of the output."""
        if self.named:
            if text:
                self.calls[0].args.append(text)
            for ch in text:
                self._track(ch)
            return
        args: list[str] = []
        for ch in text:
            if self.in_string:
                if self.args:
                    args.append(ch)
                elif self.capture is not None and not (ch == '"' and not self.escape):
                    self.capture.append(ch)
                self._track(ch)
                if not self.in_string and self.capture is not None:
                    self._captured()
                continue
            at_value = self.depth == 2 and self.key == "parameters" and not self.expect_key
            if at_value and not ch.isspace():
                if self.args is None:
                    self.args = True
                elif self.args and ch in ",}":
                    self.args = False
            if self.args and self.depth >= 2:
                args.append(ch)
            elif self.depth == 2:
                self._element_syntax(ch)
            self._track(ch)
            if ch == "{" and self.depth == 2:
                self.calls.append(_Call())
                self.expect_key, self.key, self.args = True, None, None
            elif ch == "}" and self.depth == 1:
                self._flush(args)
                self.calls[-1].done = True
        self._flush(args)

    def _element_syntax(self, ch: str) -> None:
        """A character of a required element's own syntax (not inside a value)."""
        if ch == '"' and (self.expect_key or self.key == "name"):
            self.capture = []
        elif ch == ":":
            self.expect_key = False
        elif ch == ",":
            self.expect_key, self.key = True, None

    def _captured(self) -> None:
        assert self.capture is not None
        value = json.loads('"' + "".join(self.capture) + '"')
        self.capture = None
        if self.expect_key:
            self.key = value
            self.args = None
        elif self.key == "name" and self.calls:
            self.calls[-1].name = value

    def _flush(self, args: list[str]) -> None:
        if args and self.calls:
            self.calls[-1].args.append("".join(args))
            args.clear()

    def _track(self, ch: str) -> None:
        """Depth and strings of the JSON text."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
            return
        if ch == '"':
            self.in_string = True
        elif ch in "[{":
            self.depth += 1
        elif ch in "]}":
            self.depth -= 1
        if not ch.isspace():
            self.opened = True

    def tool_calls(self) -> list[ToolCall]:
        """The calls read so far (the last one's arguments may be partial)."""
        return [c.tool_call() for c in self.calls if c.name is not None]

    def pieces(self, whole: bool = False) -> list[DeltaToolCall]:
        """The stream pieces of what was read since the last call: a call's first piece
        (`index`, `id`, `type`, name and the arguments so far) once its name is known, then
        pieces of `index` and new argument text. `whole`: calls are sent only once complete,
        each as one piece (at the end `rest` sends the others as they are)."""
        out: list[DeltaToolCall] = []
        for index in range(self.first_unsent, len(self.calls)):
            call = self.calls[index]
            if call.name is None or (whole and not call.done):
                break
            if whole:
                call.sent = len(call.args)
                out.append(DeltaToolCall.whole(index, call.tool_call()))
            elif call.sent < 0:
                text, call.sent = call.text, len(call.args)
                function = DeltaFunctionCall(name=call.name, arguments=text)
                out.append(
                    DeltaToolCall(index=index, id=call.id, type="function", function=function)
                )
            elif call.sent < len(call.args):
                text, call.sent = "".join(call.args[call.sent :]), len(call.args)
                out.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=text)))
            if call.done:
                self.first_unsent = index + 1
        return out

    def rest(self) -> list[DeltaToolCall]:
        """At the end of a stream sending whole calls: the calls not sent yet, as they are."""
        for call in self.calls[self.first_unsent :]:
            call.done = True
        return self.pieces(whole=True)


def parse_tool_calls(text: str, choice: str | NamedToolChoice) -> list[ToolCall] | None:
    """The tool calls in a generated text; None when it is not complete JSON (cut short)."""
    calls = ForcedCalls(choice)
    calls.feed(text)
    return calls.tool_calls() if calls.complete else None
