"""The tool-call parser interface, its registry, and the two streaming engines the formats share.

Owns:
- the result types (`ParsedCall`, `ToolParseResult`, `StreamDelta`) and `ToolParseError`;
- the abstract `ToolParser` / `ToolCallStream` and `ToolParserManager` (vLLM's
  `--tool-call-parser` names, extensible by a decorator or a lazy `"module:Class"` path);
- `MarkerToolParser`: formats whose calls sit between markers inside free text (hermes,
  qwen3_coder, nemotron_json, granite4). Content outside the markers streams as it arrives,
  holding back only a tail that could be the start of a marker; a call region is buffered and
  parsed once, when its end marker arrives (or at the end of the output);
- `WholeOutputToolParser`: formats where the whole output is the calls (llama3_json,
  pythonic, granite). The stream decides from the first non-whitespace characters whether the
  output is calls (then buffers it to the end) or content (then passes it through).

`extract(text)` runs the very same stream over the whole text, so a stream fed any split of
a text gives exactly what `extract` gives. Work is linear in the output length: no feed
re-scans what an earlier feed already scanned.

Content rule (both engines): content is all text outside the calls (before, between and
after them), verbatim. When at least one call was found and the content is only whitespace,
the content is None (the stream never sends that whitespace: it holds back leading
whitespace until non-whitespace content follows, and drops it at the end if calls were
made). When no call was found, the content is the whole text, verbatim (None for "").

A call region that cannot be parsed is, non-strict, put back as content verbatim (markers
included) while the other calls stand: a stream cannot take back calls it already sent, so
the fallback is per region, not vLLM's "whole output as content". `extract(strict=True)`
raises `ToolParseError` on the first such region instead. Arguments are always strict JSON
text (`json_text`): a region whose values cannot be (nesting past `MAX_JSON_DEPTH`, an
integer past Python's digit limit, NaN or Infinity, an escaped lone surrogate) is such a
region, so model output never fails a request or cuts a stream.
"""

from __future__ import annotations

import importlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

# --------------------------------------------------------------------------------------------
# Result types
# --------------------------------------------------------------------------------------------


@dataclass
class ParsedCall:
    """One tool call: the function name and its arguments as a JSON object text."""

    name: str
    arguments: str  # json.dumps of a dict (ensure_ascii=False); "{}" when none


@dataclass
class ToolParseResult:
    """What a whole output holds: the content outside the calls, and the calls in order."""

    content: str | None
    calls: list[ParsedCall]


@dataclass
class StreamDelta:
    """What one `feed`/`finish` yields: content to send now and the calls it completed."""

    content: str = ""
    calls: list[tuple[int, ParsedCall]] = field(default_factory=list)


class ToolParseError(ValueError):
    """Malformed call syntax; raised only by `extract(..., strict=True)`."""


# --------------------------------------------------------------------------------------------
# Interfaces
# --------------------------------------------------------------------------------------------


class ToolCallStream(ABC):
    """A per-request incremental parser: feed the output's text deltas, then `finish()`.

    The content and calls it yields, concatenated, are exactly `extract(text)`'s for the
    concatenated deltas (content `None` there is "" here). It holds back: a content tail
    that may be the start of a marker (shorter than the longest marker), leading whitespace
    until non-whitespace content follows (dropped at the end when calls were made), and a
    call region until it ends (or, for whole-output formats, everything once the output
    looks like calls)."""

    @abstractmethod
    def feed(self, delta: str) -> StreamDelta:
        """Consume the next piece of output text."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """End of output: flush held-back text and parse calls that end at EOS."""


class ToolParser(ABC):
    """A model family's tool-call format. One instance per request (it holds the tools)."""

    name: ClassVar[str] = ""
    # True when the format's markers are special tokens: the server must then detokenize
    # with skip_special_tokens=False or the markers never reach the parser.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools: list[dict[str, Any]] = list(tools or [])

    @abstractmethod
    def extract(self, text: str, strict: bool = False) -> ToolParseResult:
        """Split a whole output into content and calls."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh incremental parser for one streamed output."""


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

P = TypeVar("P", bound=type[ToolParser])


class ToolParserManager:
    """vLLM's `--tool-call-parser` names -> parser classes."""

    _parsers: ClassVar[dict[str, type[ToolParser]]] = {}
    _lazy: ClassVar[dict[str, str]] = {}

    @classmethod
    def register(cls, name: str) -> Callable[[P], P]:
        """Class decorator registering a parser under `name` (stack it for aliases).

        The class's `name` is set to the first name it is registered under unless the class
        defines one itself. A later registration under the same name replaces the earlier.
        """

        def decorate(parser_cls: P) -> P:
            if not (isinstance(parser_cls, type) and issubclass(parser_cls, ToolParser)):
                raise TypeError(f"{parser_cls!r} is not a ToolParser subclass")
            if not parser_cls.__dict__.get("name"):
                parser_cls.name = name
            cls._parsers[name] = parser_cls
            cls._lazy.pop(name, None)
            return parser_cls

        return decorate

    @classmethod
    def register_module(cls, name: str, path: str) -> None:
        """Register `name` lazily: `path` is "package.module:ClassName", imported on `get`."""
        if ":" not in path:
            raise ValueError(f"expected 'package.module:ClassName', got {path!r}")
        cls._lazy[name] = path
        cls._parsers.pop(name, None)

    @classmethod
    def get(cls, name: str) -> type[ToolParser]:
        """The parser class for `name`; ValueError naming the known parsers if unknown."""
        if name in cls._parsers:
            return cls._parsers[name]
        if name in cls._lazy:
            module_name, _, attr = cls._lazy[name].partition(":")
            parser_cls = getattr(importlib.import_module(module_name), attr)
            cls.register(name)(parser_cls)
            return parser_cls
        raise ValueError(
            f"unknown tool call parser {name!r}; known parsers: {', '.join(cls.names())}"
        )

    @classmethod
    def names(cls) -> list[str]:
        """All registered names, sorted."""
        return sorted(set(cls._parsers) | set(cls._lazy))


# --------------------------------------------------------------------------------------------
# Helpers shared by the formats
# --------------------------------------------------------------------------------------------


# Output that cannot be turned into strict JSON arguments is not a call: its region falls back
# to content. Nesting deeper than this (a model looping on `[` or `{"a":`) is refused before
# `json` recurses into it.
MAX_JSON_DEPTH = 64
_JSON_SYNTAX = re.compile(r'[\[\]{}"\\]')


def json_depth(text: str, limit: int = MAX_JSON_DEPTH) -> int:
    """The deepest bracket nesting of JSON text, brackets inside strings not counted (the
    text need not be valid). Linear; stops counting once past `limit`."""
    depth = deepest = 0
    in_string = False
    escaped_at = -1
    for match in _JSON_SYNTAX.finditer(text):
        i = match.start()
        if i == escaped_at:
            continue
        c = text[i]
        if in_string:
            if c == "\\":
                escaped_at = i + 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif c in "]}":
            depth = max(depth - 1, 0)
    return deepest


def loads_json(text: str, what: str) -> Any:
    """json.loads of model text, every failure (bad syntax, nesting past `MAX_JSON_DEPTH`,
    an integer over Python's digit limit) raised as ToolParseError naming `what`."""
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ToolParseError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ToolParseError(f"{what} is not valid JSON: {e}") from None


def json_text(value: Any, what: str) -> str:
    """`value` as strict JSON text (ensure_ascii=False): no NaN or Infinity, nesting within
    `MAX_JSON_DEPTH`, valid Unicode (no lone surrogate, which a model can write as an escape).
    Anything else raises ToolParseError naming `what`."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise ToolParseError(f"{what} cannot be written as JSON: {e}") from None
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ToolParseError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")
    check_unicode(text, what)
    return text


def check_unicode(text: str, what: str) -> None:
    """ToolParseError when `text` holds a lone surrogate (it cannot be sent as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ToolParseError(f"{what} holds a lone surrogate (not valid Unicode)") from None


def arguments_json(value: Any, what: str = "arguments") -> str:
    """The arguments as JSON object text: a dict, None (-> "{}"), or a JSON string holding
    an object (decoded, as vLLM does). Anything else raises ToolParseError."""
    if value is None:
        return "{}"
    if isinstance(value, str):
        value = loads_json(value, f"{what} (a string)")
    if not isinstance(value, dict):
        raise ToolParseError(f"{what} must be a JSON object, got {type(value).__name__}")
    return json_text(value, what)


def call_from_object(obj: Any, arg_keys: Iterable[str] = ("arguments", "parameters")) -> ParsedCall:
    """A call from a decoded `{"name": ..., "arguments": {...}}` object (the arguments key
    may be any of `arg_keys`; a missing one means no arguments)."""
    if not isinstance(obj, dict):
        raise ToolParseError(f"a call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ToolParseError('a call needs a non-empty string "name"')
    check_unicode(name, "the call's name")
    args: Any = None
    for key in arg_keys:
        if key in obj:
            args = obj[key]
            break
    return ParsedCall(name=name, arguments=arguments_json(args, f"the arguments of {name!r}"))


def find_tool_properties(tools: list[Any], name: str) -> dict[str, Any]:
    """The `parameters.properties` schema of the request's tool `name` ({} if unknown)."""
    for tool in tools:
        if hasattr(tool, "model_dump"):
            tool = tool.model_dump()
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function", tool)
        if isinstance(fn, Mapping) and fn.get("name") == name:
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, Mapping) else None
            return dict(props) if isinstance(props, Mapping) else {}
    return {}


def partial_marker_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker (only the
    last `len(marker) - 1` characters are looked at)."""
    best = 0
    for m in markers:
        if len(m) < 2:
            continue
        window = text[-(len(m) - 1) :]
        i = window.find(m[0])
        while i >= 0 and len(window) - i > best:
            if m.startswith(window[i:]):
                best = len(window) - i
                break
            i = window.find(m[0], i + 1)
    return best


class _ContentGate:
    """Sends content, holding back leading whitespace until non-whitespace content follows
    (so content that is only whitespace around calls is never sent); counts the calls."""

    def __init__(self) -> None:
        self.started = False
        self.held_ws = ""
        self.n_calls = 0

    def content(self, text: str) -> str:
        if self.started or not text:
            return text
        text = self.held_ws + text
        if text.strip():
            self.started = True
            self.held_ws = ""
            return text
        self.held_ws = text
        return ""

    def calls(self, calls: list[ParsedCall]) -> list[tuple[int, ParsedCall]]:
        out = [(self.n_calls + i, c) for i, c in enumerate(calls)]
        self.n_calls += len(calls)
        return out

    def end(self) -> str:
        """At EOS: held whitespace is content only when no call was made."""
        held, self.held_ws = self.held_ws, ""
        return held if self.n_calls == 0 else ""


def _run_whole(stream: ToolCallStream, text: str) -> ToolParseResult:
    a = stream.feed(text)
    b = stream.finish()
    content = a.content + b.content
    calls = [c for _, c in a.calls + b.calls]
    if calls and not content.strip():
        return ToolParseResult(content=None, calls=calls)
    return ToolParseResult(content=content or None, calls=calls)


# --------------------------------------------------------------------------------------------
# Engine 1: call regions between markers inside free text
# --------------------------------------------------------------------------------------------


class EndScanner:
    """Finds a region's end marker incrementally. With `open_`/`close` (e.g. `<parameter=`,
    `</parameter>`), end markers between an open and its close are literal text, skipped.

    `scan(delta)` returns the (start, stop) offsets of the end marker counted from the start
    of the region body, or None; each character is examined a bounded number of times."""

    def __init__(self, end: str, open_: str | None = None, close: str | None = None) -> None:
        self.end = end
        self.open = open_
        self.close = close
        self.keep = max(len(m) for m in (end, open_ or "", close or "")) - 1
        self.tail = ""
        self.offset = 0  # body offset of self.tail[0]
        self.inside = False

    def scan(self, delta: str) -> tuple[int, int] | None:
        window = self.tail + delta
        pos = 0
        while True:
            if self.inside:
                assert self.close is not None
                i = window.find(self.close, pos)
                if i < 0:
                    break
                self.inside = False
                pos = i + len(self.close)
                continue
            i_end = window.find(self.end, pos)
            i_open = window.find(self.open, pos) if self.open else -1
            if i_open >= 0 and (i_end < 0 or i_open < i_end):
                self.inside = True
                pos = i_open + len(self.open or "")
                continue
            if i_end >= 0:
                return self.offset + i_end, self.offset + i_end + len(self.end)
            break
        cut = max(pos, len(window) - self.keep)
        self.tail = window[cut:]
        self.offset += cut
        return None


_PIECE = 4096


class MarkerToolParser(ToolParser):
    """Calls sit in regions `START body END` inside free text; subclasses say how."""

    start_markers: ClassVar[tuple[str, ...]] = ()
    # Whether a region still open at EOS is parsed (vLLM hermes does) or is content.
    parse_unclosed: ClassVar[bool] = True

    @abstractmethod
    def end_scanner(self, start: str) -> EndScanner:
        """The scanner finding the end of a region opened by `start`."""

    @abstractmethod
    def parse_region(self, start: str, body: str, closed: bool) -> list[ParsedCall]:
        """The calls in one region's body (markers excluded); ToolParseError if malformed.
        `closed` is False for a region cut by the end of the output."""

    def stream(self) -> ToolCallStream:
        return MarkerStream(self)

    def extract(self, text: str, strict: bool = False) -> ToolParseResult:
        return _run_whole(MarkerStream(self, strict=strict), text)


class MarkerStream(ToolCallStream):
    """The incremental engine of `MarkerToolParser` (see the module docstring)."""

    def __init__(self, parser: MarkerToolParser, strict: bool = False) -> None:
        self.parser = parser
        self.strict = strict
        self.gate = _ContentGate()
        self.held = ""  # content-mode tail that may be the start of a marker
        self.start: str | None = None  # the open region's start marker, None in content mode
        self.chunks: list[str] = []  # the open region's body so far
        self.scanner: EndScanner | None = None
        self.done = False

    def feed(self, delta: str) -> StreamDelta:
        if self.done:
            raise RuntimeError("feed() after finish()")
        out = StreamDelta()
        # A long delta (extract's whole text) goes in bounded pieces, so that the copies and
        # searches after each region are bounded by a piece, not by the rest of the text.
        for i in range(0, len(delta), _PIECE):
            self._feed_piece(delta[i : i + _PIECE], out)
        return out

    def _feed_piece(self, text: str, out: StreamDelta) -> None:
        while True:
            if self.start is None:
                text = self.held + text
                self.held = ""
                hit = self._first_marker(text)
                if hit is None:
                    k = partial_marker_len(text, self.parser.start_markers)
                    self.held = text[len(text) - k :] if k else ""
                    out.content += self.gate.content(text[: len(text) - k])
                    return
                i, marker = hit
                out.content += self.gate.content(text[:i])
                self.start = marker
                self.chunks = []
                self.scanner = self.parser.end_scanner(marker)
                text = text[i + len(marker) :]
            assert self.scanner is not None
            span = self.scanner.scan(text)
            self.chunks.append(text)
            if span is None:
                return
            body = "".join(self.chunks)
            rest = body[span[1] :]
            self._close(body[: span[0]], body[span[0] : span[1]], True, out)
            text = rest

    def finish(self) -> StreamDelta:
        if self.done:
            return StreamDelta()
        self.done = True
        out = StreamDelta()
        if self.start is not None:
            self._close("".join(self.chunks), "", False, out)
        out.content += self.gate.content(self.held)
        self.held = ""
        out.content += self.gate.end()
        return out

    def _first_marker(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for m in self.parser.start_markers:
            i = text.find(m, 0, len(text) if best is None else best[0] + len(m))
            if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(m) > len(best[1]))):
                best = (i, m)
        return best

    def _close(self, body: str, end: str, closed: bool, out: StreamDelta) -> None:
        start = self.start
        assert start is not None
        self.start, self.scanner, self.chunks = None, None, []
        try:
            if not closed and not self.parser.parse_unclosed:
                raise ToolParseError(f"{start} is not closed at the end of the output")
            calls = self.parser.parse_region(start, body, closed)
        except ToolParseError as e:
            if self.strict:
                raise ToolParseError(f"{self.parser.name}: {e}") from None
            out.content += self.gate.content(start + body + end)
            return
        out.calls += self.gate.calls(calls)


# --------------------------------------------------------------------------------------------
# Engine 2: the whole output is the calls
# --------------------------------------------------------------------------------------------


class WholeOutputToolParser(ToolParser):
    """The output, after leading whitespace, is the calls when it starts with one of
    `call_prefixes`; otherwise it is plain content."""

    call_prefixes: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def parse_output(self, text: str) -> list[ParsedCall]:
        """The calls (at least one) in an output that starts with a call prefix (its leading
        whitespace removed); ToolParseError if it is not a well-formed call output."""

    def stream(self) -> ToolCallStream:
        return WholeOutputStream(self)

    def extract(self, text: str, strict: bool = False) -> ToolParseResult:
        return _run_whole(WholeOutputStream(self, strict=strict), text)


class WholeOutputStream(ToolCallStream):
    """The incremental engine of `WholeOutputToolParser`: undecided while the output is
    whitespace or a prefix of a call prefix; then either content (passed through) or calls
    (buffered and parsed once at `finish`)."""

    def __init__(self, parser: WholeOutputToolParser, strict: bool = False) -> None:
        self.parser = parser
        self.strict = strict
        self.gate = _ContentGate()  # holds the leading whitespace
        self.mode = "undecided"  # -> "content" | "calls"
        self.head = ""  # while undecided: the text after the leading whitespace
        self.chunks: list[str] = []  # in "calls" mode: the output after its leading whitespace
        self.done = False

    def feed(self, delta: str) -> StreamDelta:
        if self.done:
            raise RuntimeError("feed() after finish()")
        if self.mode == "content":
            return StreamDelta(content=self.gate.content(delta))
        if self.mode == "calls":
            self.chunks.append(delta)
            return StreamDelta()
        if not self.head:
            stripped = delta.lstrip()
            self.gate.content(delta[: len(delta) - len(stripped)])  # held, nothing sent yet
            delta = stripped
        self.head += delta
        if not self.head:
            return StreamDelta()
        prefixes = self.parser.call_prefixes
        if any(self.head.startswith(p) for p in prefixes):
            self.mode = "calls"
            self.chunks = [self.head]
            self.head = ""
            return StreamDelta()
        if any(p.startswith(self.head) for p in prefixes):
            return StreamDelta()
        self.mode = "content"
        head, self.head = self.head, ""
        return StreamDelta(content=self.gate.content(head))

    def finish(self) -> StreamDelta:
        if self.done:
            return StreamDelta()
        self.done = True
        out = StreamDelta()
        text = "".join(self.chunks) + self.head
        self.chunks, self.head = [], ""
        if text and any(text.startswith(p) for p in self.parser.call_prefixes):
            try:
                out.calls += self.gate.calls(self.parser.parse_output(text))
                text = ""
            except ToolParseError as e:
                if self.strict:
                    raise ToolParseError(f"{self.parser.name}: {e}") from None
        out.content += self.gate.content(text)
        out.content += self.gate.end()
        return out
