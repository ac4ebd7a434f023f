"""The reasoning-parser interface (`--reasoning-parser NAME`), its registry and the
marker machinery the parsers share.

A reasoning parser splits a generated text into its reasoning part and its answer
(content), whole (`ReasoningParser.extract`) or as the text streams in
(`ReasoningParser.stream`, one `ReasoningStream` per choice). The server asks
`starts_in_reasoning(prompt)` once per request: whether the chat template already opened
the reasoning part at the end of the generation prompt. That one answer decides both how
the output is read and where a grammar starts (after `end_marker` when the output starts
in reasoning, else at the first token: `OutputParsing.grammar_start_after`), so the two
never disagree.

This module owns:

- `ReasoningStream` / `ReasoningParser`: the interface the server uses;
- `ReasoningParserManager`: the registry of names, as vLLM's;
- `Boundary`, `Markers` and `MarkerParser`: a parser described by the markers that may
  open the output's reasoning part (only at the very start of the output) and the
  boundaries that end it. Its stream holds back only a tail that could still become a
  marker (bounded by the longest marker), so the work per request is linear in the
  output; `extract` is the same machine fed the whole text at once, so a streamed split
  always agrees with the whole.

Markers are removed; the text around them is kept as generated (no newline is
stripped), as vLLM does: Qwen3's "<think>\\nA\\n</think>\\n\\nB" gives reasoning "\\nA\\n"
and content "\\n\\nB".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar


class ReasoningStream(ABC):
    """Splits one choice's output as it streams in."""

    @abstractmethod
    def feed(self, delta: str) -> tuple[str, str]:
        """Takes the next piece of text; returns (reasoning, content) to send now."""

    @abstractmethod
    def finish(self) -> tuple[str, str]:
        """The output has ended: returns (reasoning, content) that was held back."""

    @property
    @abstractmethod
    def in_reasoning(self) -> bool:
        """True while the stream is inside the reasoning part."""


class ReasoningParser(ABC):
    """One reasoning format. Instances are per request (they hold its template kwargs)."""

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False
    end_marker: ClassVar[str]

    def __init__(self, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.chat_template_kwargs: dict[str, Any] = dict(chat_template_kwargs or {})

    @property
    def thinking_enabled(self) -> bool:
        """Whether the request lets the model reason: False only for `enable_thinking:
        false` (the templates test `is false`)."""
        return self.chat_template_kwargs.get("enable_thinking") is not False

    @abstractmethod
    def starts_in_reasoning(self, prompt: str) -> bool:
        """Whether the generated text begins inside the reasoning part, given the
        rendered prompt text and the request's chat template kwargs."""

    @abstractmethod
    def extract(self, text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part."""

    @abstractmethod
    def stream(self, in_reasoning: bool) -> ReasoningStream:
        """A stream for one choice whose output starts in (or out of) reasoning."""


class ReasoningParserManager:
    """The registry of reasoning parsers by their `--reasoning-parser` name."""

    _parsers: ClassVar[dict[str, type[ReasoningParser]]] = {}

    @classmethod
    def register(cls, name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
        """Class decorator: registers the parser under `name` (and sets its `name`)."""

        def wrap(parser: type[ReasoningParser]) -> type[ReasoningParser]:
            if name in cls._parsers and cls._parsers[name] is not parser:
                raise ValueError(f"reasoning parser {name!r} is already registered")
            parser.name = name
            cls._parsers[name] = parser
            return parser

        return wrap

    @classmethod
    def get(cls, name: str) -> type[ReasoningParser]:
        """The parser class registered as `name`; ValueError naming the known ones."""
        try:
            return cls._parsers[name]
        except KeyError:
            known = ", ".join(cls.names())
            raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {known}") from None

    @classmethod
    def names(cls) -> list[str]:
        """The registered names, sorted."""
        return sorted(cls._parsers)


class Boundary(ABC):
    """Something in the reasoning text that ends the reasoning part."""

    @abstractmethod
    def find(self, text: str) -> tuple[int, int] | None:
        """The first complete occurrence in `text`: (where the reasoning stops, where the
        content starts), or None."""

    @abstractmethod
    def hold_from(self, text: str) -> int:
        """The smallest index i such that `text[i:]` could still grow into an occurrence
        (len(text) when none can); only a bounded tail is ever examined."""


class Markers(Boundary):
    """Literal markers, removed from the output. No marker may contain another's prefix
    in its middle (true of every marker used here), so the first complete occurrence is
    the boundary."""

    def __init__(self, *markers: str) -> None:
        assert markers and all(markers)
        self.markers = markers
        self._longest = max(len(m) for m in markers)

    def find(self, text: str) -> tuple[int, int] | None:
        best: tuple[int, int] | None = None
        for marker in self.markers:
            at = text.find(marker)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, at + len(marker))
        return best

    def hold_from(self, text: str) -> int:
        n = len(text)
        for k in range(min(self._longest - 1, n), 0, -1):
            tail = text[n - k :]
            if any(m.startswith(tail) for m in self.markers):
                return n - k
        return n


_START, _REASONING, _CONTENT = 0, 1, 2


class MarkerStream(ReasoningStream):
    """The stream of a `MarkerParser`: a three-state machine (start of output, in
    reasoning, in content) that holds back only a possible marker prefix."""

    def __init__(
        self, starts: tuple[str, ...], ends: tuple[Boundary, ...], in_reasoning: bool
    ) -> None:
        self._starts = starts
        self._ends = ends
        self._base = _REASONING if in_reasoning else _CONTENT
        self._state = _START if starts else self._base
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        if self._state == _START:
            return self._base == _REASONING
        return self._state == _REASONING

    def feed(self, delta: str) -> tuple[str, str]:
        text = self._held + delta
        self._held = ""
        reasoning = ""
        if self._state == _START:
            for start in self._starts:
                if text.startswith(start):
                    text = text[len(start) :]
                    self._state = _REASONING
                    break
            else:
                if any(start.startswith(text) for start in self._starts):
                    self._held = text  # still maybe a start marker
                    return "", ""
                self._state = self._base
        if self._state == _REASONING:
            hit: tuple[int, int] | None = None
            for boundary in self._ends:
                found = boundary.find(text)
                if found is not None and (hit is None or found[0] < hit[0]):
                    hit = found
            if hit is None:
                cut = min((b.hold_from(text) for b in self._ends), default=len(text))
                self._held = text[cut:]
                return text[:cut], ""
            reasoning, text = text[: hit[0]], text[hit[1] :]
            self._state = _CONTENT
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == _START:
            self._state = self._base
        if self._state == _REASONING:
            return held, ""
        return "", held


class MarkerParser(ReasoningParser):
    """A parser described by markers: `start_markers` open the reasoning part when the
    output begins with one (whatever `in_reasoning` says; a leading one is dropped when
    the output already starts inside it), `boundaries()` end it. Without a start marker
    the output begins in the part `in_reasoning` names. Once the reasoning has ended,
    everything else is content, markers included."""

    start_markers: ClassVar[tuple[str, ...]] = ()

    def boundaries(self) -> tuple[Boundary, ...]:
        """What ends the reasoning part; by default the `end_marker`."""
        return (Markers(self.end_marker),)

    def stream(self, in_reasoning: bool) -> ReasoningStream:
        return MarkerStream(self.start_markers, self.boundaries(), in_reasoning)

    def extract(self, text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
        stream = self.stream(in_reasoning)
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return (r1 + r2) or None, (c1 + c2) or None
