"""What a generated choice says: its reasoning, its answer and its tool calls, whole or as
stream pieces. Shared by chat completions and the Responses API.

A choice's text passes two optional parsers, in this order:
- the server's reasoning parser (`--reasoning-parser`) splits off the thinking part;
- the answer then holds tool calls: with `tool_choice="auto"`, in the model's own format,
  found by the server's tool-call parser (`--tool-call-parser`; text that is not a well-formed
  call stays content, as vLLM does); with `"required"` or a named function, as the JSON the
  tools' grammar generated (`tool_calls.ForcedCalls`), never as content. Cut short by
  `max_tokens`, such a choice finishes with `"length"` and the calls generated so far, the
  last one's arguments partial (OpenAI's contract).

Streams do work proportional to each new piece of text: the reasoning and tool parsers hold
back only what could be the start of a marker. An "auto" call is sent whole (one piece with
its `index`, `id`, name and arguments) once its text is complete; a required or named call
streams as it is generated in chat completions (its first piece with `index`, `id`, `type`,
name and the arguments so far, then `index` and argument text), and whole in the Responses
API.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from vllm_mamba.entrypoints.openai.reasoning import ReasoningParser, ReasoningStream
from vllm_mamba.entrypoints.openai.tool_calls import (
    DeltaToolCall,
    ForcedCalls,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from vllm_mamba.entrypoints.openai.tool_parsers import ToolCallStream, ToolParser


class ToolOutputError(ValueError):
    """A required or named tool choice whose output ended, not cut by `max_tokens`, before
    the call was complete (which the request checks and the grammar rule out); `status` is
    the HTTP status to answer with."""

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
            forced = self.forced()
            forced.feed(content or "")
            self.check_complete(forced, finish_reason)
            calls = forced.tool_calls()
            content = None
        return ParsedChoice(
            reasoning, content, calls, self.finish_reason(bool(calls), finish_reason)
        )

    def grammar_start_after(self) -> str | None:
        """The text after which a grammar (structured outputs, a required or named tool
        choice) starts: the end of the reasoning when the output starts inside it, as the
        reasoning parser reads it (`in_reasoning`, decided once from the prompt by
        `starts_in_reasoning`); else None, the grammar applies from the first token (and
        the output is content from the start)."""
        if self.reasoning is not None and self.in_reasoning:
            return self.reasoning.end_marker
        return None

    def finish_reason(self, made_calls: bool, finish_reason: str | None) -> str | None:
        """`tool_calls` when a stopped choice made calls with "auto" or "required" (vLLM; a
        named choice keeps `stop`)."""
        if made_calls and finish_reason == "stop" and self.tool_mode in ("auto", "required"):
            return "tool_calls"
        return finish_reason

    def forced(self) -> ForcedCalls:
        """A reader of a required or named choice's calls."""
        choice: Any = self.named if self.tool_mode == "named" else "required"
        return ForcedCalls(choice)

    def check_complete(self, forced: ForcedCalls, finish_reason: str | None) -> None:
        """A required or named answer is complete unless `max_tokens` cut it (`length`).

        Raises:
            ToolOutputError: it ended otherwise before the call was complete.
        """
        if finish_reason == "length":
            return
        if not forced.complete or not all(_is_json(c.text) for c in forced.calls if c.name):
            raise ToolOutputError(
                f"tool_choice {self.tool_mode}: the output ended without a complete, "
                f"well-formed tool call (finish reason {finish_reason})",
                500,
            )

    def stream(self, incremental: bool = False) -> ChoiceStream:
        """A stream reader for one choice; `incremental`: required and named calls stream
        as they are generated (else each is sent whole once complete)."""
        return ChoiceStream(self, incremental)


class ChoiceStream:
    """Turns one choice's text deltas into stream pieces (see the module docstring)."""

    def __init__(self, parsing: OutputParsing, incremental: bool = False) -> None:
        self.parsing = parsing
        self.incremental = incremental
        self.reasoning: ReasoningStream | None = None
        if parsing.reasoning is not None:
            self.reasoning = parsing.reasoning.stream(parsing.in_reasoning)
        self.tools: ToolCallStream | None = None
        if parsing.tool_mode == "auto" and parsing.tool_parser is not None:
            self.tools = parsing.tool_parser.stream()
        self.forced: ForcedCalls | None = None
        if parsing.tool_mode in ("required", "named"):
            self.forced = parsing.forced()
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
            self.parsing.check_complete(self.forced, finish_reason)
            rest = self.forced.pieces() if self.incremental else self.forced.rest()
            piece.tool_calls += self._count(rest)
        return piece

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """The finish reason to report (`tool_calls` once calls were sent)."""
        return self.parsing.finish_reason(self.num_calls > 0, finish_reason)

    def _answer(self, thought: str, answer: str) -> StreamPiece:
        piece = StreamPiece(reasoning=thought if self.parsing.include_reasoning else "")
        if not answer:
            return piece
        if self.forced is not None:
            self.forced.feed(answer)
            piece.tool_calls = self._count(self.forced.pieces(whole=not self.incremental))
        elif self.tools is not None:
            out = self.tools.feed(answer)
            piece.content = out.content
            piece.tool_calls = self._send([_tool_call(c.name, c.arguments) for _, c in out.calls])
        else:
            piece.content = answer
        return piece

    def _count(self, pieces: list[DeltaToolCall]) -> list[DeltaToolCall]:
        """`pieces` of forced calls, counting the calls they start."""
        self.num_calls += sum(1 for p in pieces if p.id is not None)
        return pieces

    def _send(self, calls: list[ToolCall]) -> list[DeltaToolCall]:
        """Stream pieces of whole calls, numbered after those already sent."""
        start, self.num_calls = self.num_calls, self.num_calls + len(calls)
        return [DeltaToolCall.whole(start + i, call) for i, call in enumerate(calls)]


def _is_json(text: str) -> bool:
    """Whether `text` is one JSON value. Numbers are not converted (so no digit limit), and
    nesting deeper than Python's parser goes is taken as written."""
    try:
        json.loads(text, parse_int=len, parse_float=len)
    except RecursionError:
        return True
    except ValueError:
        return False
    return True


def _tool_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(function=FunctionCall(name=name, arguments=arguments))
