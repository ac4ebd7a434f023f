"""What a generated choice says: its reasoning, its answer and its tool calls, whole or as
stream pieces. Shared by chat completions and the Responses API.

A choice's text passes two optional parsers, in this order:
- the server's reasoning parser (`--reasoning-parser`) splits off the thinking part;
- the answer then holds tool calls: with `tool_choice="auto"`, in the model's own format,
  found by the server's tool-call parser (`--tool-call-parser`; text that is not a well-formed
  call stays content, as vLLM does); with `"required"` or a named function, as the JSON the
  tools' grammar generated (a text that is not complete JSON is a `ToolOutputError`: the
  client asked for a call and gets an error, never a silent `content`).

Streams do work proportional to each new piece of text: the reasoning and tool parsers hold
back only what could be the start of a marker, and a call is sent whole (one piece with its
`index`, `id`, name and arguments) once its text is complete.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_mamba.entrypoints.openai.reasoning import ReasoningParser, ReasoningStream
from vllm_mamba.entrypoints.openai.tool_calls import (
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    parse_tool_calls,
)
from vllm_mamba.entrypoints.openai.tool_parsers import ToolCallStream, ToolParser


class ToolOutputError(ValueError):
    """A required or named tool choice whose output is not a complete call; `status` is the
    HTTP status to answer with (400 when `max_tokens` cut it short)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ParsedChoice:
    """A finished choice: its reasoning, its answer text and its tool calls."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None


@dataclass
class StreamPiece:
    """What a stream sends now for one choice."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class OutputParsing:
    """How one request's choices are read.

    Args:
        reasoning: the reasoning parser (None: the whole text is the answer).
        in_reasoning: the output starts inside the reasoning part (the prompt opened it).
        include_reasoning: send the reasoning (vLLM's `include_reasoning`); when False it is
            parsed and dropped.
        tool_mode: None (tools unused), "auto", "required" or "named".
        tool_parser: the model's tool-call parser (used with "auto").
        named: the named choice (with "named").
    """

    reasoning: ReasoningParser | None = None
    in_reasoning: bool = False
    include_reasoning: bool = True
    tool_mode: str | None = None
    tool_parser: ToolParser | None = None
    named: NamedToolChoice | None = None

    def parse(self, text: str, finish_reason: str | None) -> ParsedChoice:
        """The parts of a finished choice's text.

        Raises:
            ToolOutputError: a required or named choice whose answer is not a complete call.
        """
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(text, self.in_reasoning)
        if not self.include_reasoning:
            reasoning = None
        calls: list[ToolCall] = []
        if self.tool_mode == "auto" and self.tool_parser is not None and content:
            found = self.tool_parser.extract(content)
            content = found.content
            calls = [_tool_call(c.name, c.arguments) for c in found.calls]
        elif self.tool_mode in ("required", "named"):
            calls = self.forced_calls(content or "", finish_reason)
            content = None
        return ParsedChoice(
            reasoning, content, calls, self.finish_reason(bool(calls), finish_reason)
        )

    def finish_reason(self, made_calls: bool, finish_reason: str | None) -> str | None:
        """`tool_calls` when a stopped choice made calls with "auto" or "required" (vLLM; a
        named choice keeps `stop`)."""
        if made_calls and finish_reason == "stop" and self.tool_mode in ("auto", "required"):
            return "tool_calls"
        return finish_reason

    def forced_calls(self, text: str, finish_reason: str | None) -> list[ToolCall]:
        """The calls of a required or named choice's answer.

        Raises:
            ToolOutputError: the answer is not a complete call.
        """
        choice: Any = self.named if self.tool_mode == "named" else "required"
        calls = parse_tool_calls(text, choice)
        if calls is not None:
            return calls
        if finish_reason == "length":
            raise ToolOutputError(
                "the tool call was cut short by max_tokens before it was complete: raise "
                "max_tokens (or max_completion_tokens)",
                400,
            )
        raise ToolOutputError(
            f"tool_choice {self.tool_mode}: the output is not a complete tool call "
            f"(finish reason {finish_reason})",
            500,
        )

    def stream(self) -> ChoiceStream:
        """A stream reader for one choice."""
        return ChoiceStream(self)


class ChoiceStream:
    """Turns one choice's text deltas into stream pieces (see the module docstring)."""

    def __init__(self, parsing: OutputParsing) -> None:
        self.parsing = parsing
        self.reasoning: ReasoningStream | None = None
        if parsing.reasoning is not None:
            self.reasoning = parsing.reasoning.stream(parsing.in_reasoning)
        self.tools: ToolCallStream | None = None
        if parsing.tool_mode == "auto" and parsing.tool_parser is not None:
            self.tools = parsing.tool_parser.stream()
        self.forced: list[str] | None = [] if parsing.tool_mode in ("required", "named") else None
        self.num_calls = 0

    def feed(self, delta: str) -> StreamPiece:
        """The pieces of a new text delta."""
        if self.reasoning is not None:
            thought, answer = self.reasoning.feed(delta)
        else:
            thought, answer = "", delta
        return self._answer(thought, answer)

    def finish(self, finish_reason: str | None) -> StreamPiece:
        """The last pieces once the choice is finished.

        Raises:
            ToolOutputError: a required or named choice without a complete call.
        """
        thought, answer = self.reasoning.finish() if self.reasoning is not None else ("", "")
        piece = self._answer(thought, answer)
        if self.tools is not None:
            rest = self.tools.finish()
            piece.content += rest.content
            piece.tool_calls += self._send([_tool_call(c.name, c.arguments) for _, c in rest.calls])
        if self.forced is not None:
            piece.tool_calls += self._send(
                self.parsing.forced_calls("".join(self.forced), finish_reason)
            )
        return piece

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """The finish reason to report (`tool_calls` once calls were sent)."""
        return self.parsing.finish_reason(self.num_calls > 0, finish_reason)

    def _answer(self, thought: str, answer: str) -> StreamPiece:
        piece = StreamPiece(reasoning=thought if self.parsing.include_reasoning else "")
        if not answer:
            return piece
        if self.forced is not None:
            self.forced.append(answer)
        elif self.tools is not None:
            out = self.tools.feed(answer)
            piece.content = out.content
            piece.tool_calls = self._send([_tool_call(c.name, c.arguments) for _, c in out.calls])
        else:
            piece.content = answer
        return piece

    def _send(self, calls: list[ToolCall]) -> list[DeltaToolCall]:
        """Stream pieces of whole calls, numbered after those already sent."""
        start, self.num_calls = self.num_calls, self.num_calls + len(calls)
        return [DeltaToolCall.whole(start + i, call) for i, call in enumerate(calls)]


def _tool_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(function=FunctionCall(name=name, arguments=arguments))
