"""`granite` (Granite 3.x) and `granite4` (Granite 4.0, 4.0-H) calls.

- `granite`: the whole output is `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`
  (Granite 3.0's special token; Granite 3.1+ writes the string `<tool_call>` instead; a bare
  JSON list is accepted too, as in vLLM). Anything else is content.
- `granite4`: hermes-like `<tool_call>{...}</tool_call>` regions in free text; unlike hermes,
  a region left open at the end of the output is content (vLLM's granite4 rejects it).

Both need skip_special_tokens=False: the markers are special tokens.
"""

from __future__ import annotations

from typing import ClassVar

from .base import (
    ParsedCall,
    ToolParseError,
    ToolParserManager,
    WholeOutputToolParser,
    call_from_object,
    loads_json,
)
from .hermes import HermesToolParser

BOT_TOKEN = "<|tool_call|>"
BOT_STRING = "<tool_call>"


@ToolParserManager.register("granite")
class GraniteToolParser(WholeOutputToolParser):
    """A JSON list of calls, optionally after `<|tool_call|>` / `<tool_call>`, to the end."""

    needs_special_tokens: ClassVar[bool] = True
    call_prefixes: ClassVar[tuple[str, ...]] = (BOT_TOKEN, BOT_STRING, "[")

    def parse_output(self, text: str) -> list[ParsedCall]:
        payload = text.strip().removeprefix(BOT_TOKEN).removeprefix(BOT_STRING).strip()
        if not payload.startswith("["):
            raise ToolParseError("expected a JSON list of calls after the tool-call marker")
        items = loads_json(payload, "the tool-call list")
        if not isinstance(items, list) or not items:
            raise ToolParseError("the tool-call list must be a non-empty JSON list")
        return [call_from_object(item, ("arguments",)) for item in items]


@ToolParserManager.register("granite4")
class Granite4ToolParser(HermesToolParser):
    """Hermes regions; an unclosed region at the end of the output is content."""

    needs_special_tokens: ClassVar[bool] = True
    parse_unclosed: ClassVar[bool] = False
